"""`KafkaSource`: frames read back by exact offset range, with a consumer connected ahead when
`prepare` started one, and fetching and decoding ahead when `read_ahead` guessed the next read
(docs/design/kafka.md)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from confluent_kafka import Message
from confluent_kafka.admin import AdminClient

from ckpt.stream.frames import Frame, FrameError, decode_frame, kafka_where
from ckpt.stream.kafka.admin import _at, new_admin
from ckpt.stream.kafka.consumer import (
    DEFAULT_READ_BUFFER_KB,
    _connect_on_thread,
    _ConnectAhead,
    _consumer_conf,
    _topics_for,
)
from ckpt.stream.kafka.decoded_ahead import Decoded, DecodedAhead
from ckpt.stream.kafka.partitions import _Read, _read_partitions
from ckpt.stream.sink import RangeRead, SourceError, check_run_id, rows_name

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 30.0
# A read ahead decodes up to the consumer's read buffer of frames, so it holds at most twice that:
# the restore's first frames (a small model's whole chain) are ready, and memory stays bounded.
DECODE_AHEAD_BYTES = DEFAULT_READ_BUFFER_KB * 1024


class _ReadAhead(NamedTuple):
    """Reads started by `read_ahead`: the partitions assigned and fetching, their frames
    decoded on a thread as they arrive."""

    reads: tuple[RangeRead, ...]
    frames: DecodedAhead  # its close closes the consumer


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
        self._ahead_lock = threading.Lock()  # `read_ahead` runs on a thread of its own
        self._ahead: _ReadAhead | None = None
        self._read_started = False  # since `prepare`: a read ahead after it would fetch for nobody
        self.reads_ahead_used = 0  # `read_ranges` calls that took over a read ahead

    def prepare(self) -> None:
        """Start connecting the consumer of the next `read_ranges` on a thread of its own. A
        restore calls this on every rank before rank 0 reads the markers log, so the rows
        read finds its client connected (docs/design/kafka.md); a `read_ahead` may follow until that read."""
        with self._ahead_lock:
            self._read_started = False
        self._connect_ahead.put(_connect_on_thread(self._cconf, self.timeout_s))

    def read_range(
        self, generation: int, partition: int, first: int, last: int, *, timeout_s: float | None = None
    ) -> Iterator[tuple[int, Frame]]:
        frames = self.read_ranges([RangeRead(generation, partition, first, last)], timeout_s=timeout_s)
        return ((pos, frame) for _, pos, frame in frames)

    def read_ahead(self, reads: Sequence[RangeRead], *, timeout_s: float | None = None) -> None:
        """Start `reads` now with the consumer `prepare` connected: librdkafka fetches them in
        the background, up to its read buffer per partition, a thread decodes the frames as
        they arrive (up to `DECODE_AHEAD_BYTES`), and a `read_ranges` of exactly these reads
        then takes the frames from there. A restarted job calls this while it
        builds its model (ckpt/log/frames_ahead.py). Anything that stops the start (a topic
        missing, no broker) only drops the read ahead: the restore's own read meets it and
        says so."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._ahead_lock:
            if self._read_started:
                return
            self._drop_ahead()
            try:
                self._ahead = _ReadAhead(
                    tuple(reads), DecodedAhead(self._start(reads, timeout_s), self._decode, DECODE_AHEAD_BYTES)
                )
            except Exception as exc:  # noqa: BLE001 - the restore's read raises it with its context
                log.debug("read ahead of %d ranges not started: %s", len(reads), exc)

    def read_ranges(self, reads: Sequence[RangeRead], *, timeout_s: float | None = None) -> Iterator[Decoded]:
        """All reads with one consumer (see `_read_partitions`): the one `read_ahead` started
        when it was given the same reads, else the one `prepare` connected, or a new one;
        every partition fetched at once, frames decoded while librdkafka fetches the next
        ones. Missing topics and partitions raise here, before the first frame is asked for."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        for r in reads:
            if not 0 <= r.first <= r.last:
                raise ValueError(f"bad range [{r.first}, {r.last}]")
        with self._ahead_lock:
            self._read_started = True
            ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead.reads == tuple(reads):
                frames = ahead.frames.take()
                if frames is not None:
                    self.reads_ahead_used += 1
                    return frames
                log.debug("read ahead of %d ranges failed: read again", len(reads))
            else:
                log.debug("read ahead of %d ranges not used: the restore reads %d others", len(ahead.reads), len(reads))
                ahead.frames.close()
        return (self._decode(i, msg) for i, msg in self._start(reads, timeout_s))

    def _start(self, reads: Sequence[RangeRead], timeout_s: float) -> Generator[tuple[int, Message], None, None]:
        """`_read_partitions` of `reads`, their topics and partitions checked first."""
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
        return _read_partitions(self._cconf, plan, timeout_s, ready.consumer if ready else None)

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.frames.close()

    def _decode(self, i: int, msg: Message) -> Decoded:
        """The frame of read `i`'s message, checked (a `FrameError` names where it lies)."""
        topic, partition, offset = _at(msg)
        where = kafka_where(topic, partition, offset)
        frame = decode_frame(msg.value() or b"", where=where)
        if frame.run_id != self.run_id:
            raise FrameError(f"frame of run {frame.run_id!r} in run {self.run_id!r}", where)
        return i, offset, frame

    def close(self) -> None:
        self._connect_ahead.close()
        with self._ahead_lock:
            self._read_started = True
            self._drop_ahead()
        if hasattr(self, "_admin"):  # closed twice: gone already
            del self._admin  # the client goes now (its connections close)
