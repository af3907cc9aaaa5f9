"""How one consumer serves several reads (`ckpt.stream.kafka.partitions._read_partitions`), with a
stand-in consumer that hands out scripted fetches: no broker needed."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError

from ckpt.stream.kafka.partitions import _Read, _read_partitions
from ckpt.stream.sink import SourceError


class Msg:
    def __init__(self, topic: str, partition: int, offset: int, err: int | None = None) -> None:
        self._key, self._offset, self._err = (topic, partition), offset, err

    def topic(self) -> str:
        return self._key[0]

    def partition(self) -> int:
        return self._key[1]

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return b""

    def error(self) -> SimpleNamespace | None:
        if self._err is None:
            return None
        return SimpleNamespace(code=lambda: self._err, fatal=lambda: False)


class ScriptedConsumer:
    """Each fetch is a list of messages that `poll` hands out in turn; `ends` is each
    partition's end as the fetches report it."""

    def __init__(self, fetches: list[list[Msg]], ends: dict[tuple[str, int], int]) -> None:
        self.fetches = deque(deque(f) for f in fetches)
        self.ends = ends
        self.assigned: list[tuple[str, int, int]] = []
        self.paused: list[tuple[str, int]] = []
        self.closed = False

    def assign(self, tps: list) -> None:
        self.assigned = [(tp.topic, tp.partition, tp.offset) for tp in tps]

    def poll(self, timeout: float) -> Msg | None:
        while self.fetches and not self.fetches[0]:
            self.fetches.popleft()
        return self.fetches[0].popleft() if self.fetches else None

    def get_watermark_offsets(self, tp, cached: bool = False) -> tuple[int, int]:
        assert cached, "a ListOffsets watermark is not trusted (launch/broker.py)"
        return 0, self.ends.get((tp.topic, tp.partition), -1001)

    def pause(self, tps: list) -> None:
        self.paused += [(tp.topic, tp.partition) for tp in tps]

    def seek(self, tp) -> None:
        raise AssertionError("no seek expected")

    def close(self) -> None:
        self.closed = True


def msgs(topic: str, partition: int, offsets: range) -> list[Msg]:
    return [Msg(topic, partition, o) for o in offsets]


def test_a_partitions_reads_come_in_one_pass_in_offset_order_and_start_fetching_when_called() -> None:
    # Newest link first: its offsets 10..19 follow the base's 0..9 in the partition.
    reads = [_Read("t", 0, 10, 19), _Read("t", 0, 0, 9)]
    consumer = ScriptedConsumer([msgs("t", 0, range(0, 15)), msgs("t", 0, range(15, 20))], {("t", 0): 20})
    messages = _read_partitions({}, reads, 1.0, consumer)
    assert consumer.assigned == [("t", 0, 0)]  # before the first message is asked for
    got = [(i, m.offset()) for i, m in messages]
    assert got == [(1, o) for o in range(0, 10)] + [(0, o) for o in range(10, 20)]
    assert consumer.paused == [("t", 0)]


def test_a_read_to_the_end_stops_at_the_end_its_fetch_reported_without_waiting_for_eof() -> None:
    # No end-of-partition event is scripted: waiting for one would time out.
    consumer = ScriptedConsumer([msgs("m", 0, range(0, 3)), msgs("m", 0, range(3, 5))], {("m", 0): 5})
    got = [m.offset() for _, m in _read_partitions({}, [_Read("m", 0, 0, None)], 0.2, consumer)]
    assert got == [0, 1, 2, 3, 4]


def test_a_read_to_the_end_of_an_empty_partition_ends_on_the_eof_event() -> None:
    consumer = ScriptedConsumer([[Msg("m", 0, 0, KafkaError._PARTITION_EOF)]], {})
    assert list(_read_partitions({}, [_Read("m", 0, 0, None)], 0.2, consumer)) == []


def test_a_read_whose_range_the_partition_does_not_reach_still_fails() -> None:
    consumer = ScriptedConsumer([msgs("t", 0, range(0, 3)) + [Msg("t", 0, 3, KafkaError._PARTITION_EOF)]], {("t", 0): 3})
    with pytest.raises(SourceError, match=r"topic t partition 0 ends at offset 3, but the range runs through offset 5"):
        list(_read_partitions({}, [_Read("t", 0, 0, 5)], 0.2, consumer))
