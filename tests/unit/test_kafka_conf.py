"""Which reader settings win: deltarec's defaults, a reader's own defaults, `ckpt.sink.kafka`."""

from __future__ import annotations

from ckpt.stream.kafka import MARKERS_FETCH_WAIT_MS, KafkaMarkers, KafkaSource

CONF = {"bootstrap.servers": "127.0.0.1:1"}  # nothing listens; building a client connects to nothing yet


def test_rows_and_markers_readers_have_their_own_fetch_wait_and_a_ckpt_kafka_setting_wins() -> None:
    source, markers = KafkaSource("c", CONF), KafkaMarkers("c", CONF)
    try:
        assert source._cconf["fetch.wait.max.ms"] == 10
        assert markers._cconf["fetch.wait.max.ms"] == MARKERS_FETCH_WAIT_MS == 100
    finally:
        source.close()
        markers.close()
    mine = {**CONF, "fetch.wait.max.ms": 250, "max.partition.fetch.bytes": 1 << 20}
    source, markers = KafkaSource("c", mine), KafkaMarkers("c", mine)
    try:
        assert source._cconf["fetch.wait.max.ms"] == markers._cconf["fetch.wait.max.ms"] == 250
        assert source._cconf["max.partition.fetch.bytes"] == 1 << 20
    finally:
        source.close()
        markers.close()
    source = KafkaSource("c", mine, consumer_conf={"fetch.wait.max.ms": 5})  # one kind of client only: wins
    assert source._cconf["fetch.wait.max.ms"] == 5
    source.close()
