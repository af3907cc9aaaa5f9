"""`KafkaSource`: frames read back by exact offset range, with a consumer connected ahead when
`prepare` started one."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from confluent_kafka import Message
from confluent_kafka.admin import AdminClient

from ckpt.stream.frames import Frame, FrameError, decode_frame, kafka_where
from ckpt.stream.kafka.admin import _at, new_admin
from ckpt.stream.kafka.consumer import _connect_on_thread, _ConnectAhead, _consumer_conf, _topics_for
from ckpt.stream.kafka.partitions import _Read, _read_partitions
from ckpt.stream.sink import RangeRead, SourceError, check_run_id, rows_name

DEFAULT_READ_TIMEOUT_S = 30.0


class KafkaSource:
    """Reads frames back by exact offset range (``assign()``, never group subscription)."""

    def __init__(
        self,
        run_id: str,
        conf: Mapping[str, Any],
        *,
        consumer_conf: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        admin: AdminClient | None = None,
    ) -> None:
        self.run_id = check_run_id(run_id)
        self.timeout_s = timeout_s
        self._cconf = _consumer_conf(conf, consumer_conf)
        self._admin = admin or new_admin(conf)
        self._connect_ahead = _ConnectAhead()

    def prepare(self) -> None:
        """Start connecting the consumer of the next `read_ranges` on a thread of its own. A
        restore calls this on every rank before rank 0 reads the markers log, so the rows
        read finds its client connected (design §6)."""
        self._connect_ahead.put(_connect_on_thread(self._cconf, self.timeout_s))

    def read_range(
        self, generation: int, partition: int, first: int, last: int, *, timeout_s: float | None = None
    ) -> Iterator[tuple[int, Frame]]:
        frames = self.read_ranges([RangeRead(generation, partition, first, last)], timeout_s=timeout_s)
        return ((pos, frame) for _, pos, frame in frames)

    def read_ranges(self, reads: Sequence[RangeRead], *, timeout_s: float | None = None) -> Iterator[tuple[int, int, Frame]]:
        """All reads with one consumer (see `_read_partitions`): the one `prepare` connected,
        or a new one; every partition fetched at once, frames decoded while librdkafka
        fetches the next ones. Missing topics and partitions raise here, before the first
        frame is asked for."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        for r in reads:
            if not 0 <= r.first <= r.last:
                raise ValueError(f"bad range [{r.first}, {r.last}]")
        topics = [rows_name(self.run_id, r.generation) for r in reads]
        ready = self._connect_ahead.take_connected()
        listed = _topics_for(ready, self._admin, topics, timeout_s) if reads or ready else {}
        try:
            plan = []
            for r, topic in zip(reads, topics):
                if topic not in listed:
                    raise SourceError(
                        f"topic {topic} does not exist (reading partition {r.partition} offsets {r.first}..{r.last})"
                    )
                if r.partition >= listed[topic]:
                    raise SourceError(f"topic {topic} has {listed[topic]} partitions, no partition {r.partition}")
                plan.append(_Read(topic, r.partition, r.first, r.last))
        except BaseException:
            if ready is not None:
                ready.consumer.close()
            raise
        return self._decoded(_read_partitions(self._cconf, plan, timeout_s, ready.consumer if ready else None))

    def _decoded(self, messages: Iterator[tuple[int, Message]]) -> Iterator[tuple[int, int, Frame]]:
        for i, msg in messages:
            topic, partition, offset = _at(msg)
            where = kafka_where(topic, partition, offset)
            frame = decode_frame(msg.value() or b"", where=where)
            if frame.run_id != self.run_id:
                raise FrameError(f"frame of run {frame.run_id!r} in run {self.run_id!r}", where)
            yield i, offset, frame

    def close(self) -> None:
        self._connect_ahead.close()
        if hasattr(self, "_admin"):  # closed twice: gone already
            del self._admin  # the client goes now (its connections close)
