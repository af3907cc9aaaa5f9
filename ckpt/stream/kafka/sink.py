"""`KafkaSink`: frames of generation N to topic ``<run>.rows.g<N>``, offsets from delivery reports.
(`ckpt/stream/sink.py`, one folder up, holds the protocols this implements.)"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message
from confluent_kafka.admin import AdminClient

from ckpt.stream.kafka.admin import _at, delete_topic, ensure_topic, new_admin
from ckpt.stream.kafka.producer import _Producer
from ckpt.stream.sink import RangeRecorder, SinkError, SinkResult, check_run_id, parse_rows_name, rows_name

log = logging.getLogger(__name__)


class KafkaSink:
    """Frames of generation N to topic ``<run>.rows.g<N>``, partition = the given partition.

    ``num_partitions`` (the world size) is used when creating a generation's topic.
    ``delivery_timeout_s`` bounds how long a frame may stay unacknowledged (librdkafka
    ``delivery.timeout.ms``); a flush with a dead broker fails after about that long.
    """

    def __init__(
        self,
        run_id: str,
        conf: Mapping[str, Any],
        *,
        num_partitions: int,
        producer_conf: Mapping[str, Any] | None = None,
        replication_factor: int = -1,
        topic_config: Mapping[str, str] | None = None,
        delivery_timeout_s: float | None = None,
        queue_full_timeout_s: float = 30.0,
        admin_timeout_s: float = 10.0,
        admin: AdminClient | None = None,
    ) -> None:
        self.run_id = check_run_id(run_id)
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
        self.num_partitions = num_partitions
        self.replication_factor = replication_factor
        self.topic_config = dict(topic_config or {})
        self.admin_timeout_s = admin_timeout_s
        self._admin = admin or new_admin(conf)
        self._p = _Producer(conf, producer_conf, delivery_timeout_s, queue_full_timeout_s)
        self._topics: dict[int, int] = {}  # generation -> partitions, checked on this broker
        self._dropped: set[int] = set()
        self._epoch = 0  # one per flush; late reports of old ones are ignored
        self._rec = RangeRecorder()
        self._error: SinkError | None = None
        self._closed = False

    def topic(self, generation: int) -> str:
        return rows_name(self.run_id, generation)

    def writable_topic(self, generation: int, partition: int) -> str:
        """The topic `write` sends frames of `generation` to, created with the sink's settings on
        first use; raises ``SinkError`` for a dropped generation or a partition the topic lacks."""
        topic = self.topic(generation)
        if generation in self._dropped:
            raise SinkError(f"generation {generation} ({topic}) was dropped; refusing to write it")
        parts = self._topics.get(generation)
        if parts is None:
            parts = ensure_topic(
                self._admin,
                topic,
                self.num_partitions,
                replication_factor=self.replication_factor,
                config=self.topic_config,
                timeout_s=self.admin_timeout_s,
            )
            self._topics[generation] = parts
        if not 0 <= partition < parts:
            raise SinkError(f"topic {topic} has {parts} partitions; cannot write partition {partition}")
        return topic

    def _fail(self, err: SinkError) -> None:
        if self._error is None:
            self._error = err

    def _on_delivery(self, epoch: int, key: tuple[int, int], err: KafkaError | None, msg: Message) -> None:
        if epoch != self._epoch:
            return
        if err is not None:
            self._fail(SinkError(f"delivery to topic {msg.topic()} partition {msg.partition()} failed: {err}"))
        else:
            offset = _at(msg)[2]
            self._rec.add(key, offset, offset + 1)

    def write(self, frame: bytes, *, generation: int, partition: int) -> None:
        if self._closed:
            raise SinkError("sink is closed")
        try:
            topic = self.writable_topic(generation, partition)
            epoch, key = self._epoch, (generation, partition)
            self._p.produce(topic, frame, partition, lambda err, msg: self._on_delivery(epoch, key, err, msg))
        except SinkError as e:
            self._fail(e)
            raise

    def flush(self, timeout_s: float) -> SinkResult:
        if self._closed:
            raise SinkError("sink is closed")
        err = self._p.flush(timeout_s)
        if err is not None:
            self._fail(err)
        result = self._rec.result(self._error)
        self._epoch += 1
        self._rec, self._error = RangeRecorder(), None
        if not result.ok:
            log.warning("kafka sink %s: flush failed (%s); recreating the producer", self.run_id, result.error)
            self._p.recreate()
            self._topics.clear()  # the broker may be a new one: check topics again
        return result

    def generations(self) -> list[int]:
        try:
            md = self._admin.list_topics(timeout=self.admin_timeout_s)
        except KafkaException as e:
            raise SinkError(f"cannot list topics: {e.args[0]}") from None
        found = (parse_rows_name(self.run_id, t) for t, meta in md.topics.items() if meta.error is None)
        return sorted(g for g in found if g is not None)

    def drop_generation(self, generation: int) -> None:
        self._dropped.add(generation)
        self._topics.pop(generation, None)
        delete_topic(self._admin, self.topic(generation), self.admin_timeout_s)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._p.close()
            del self._admin  # the client goes now (its connections close)
