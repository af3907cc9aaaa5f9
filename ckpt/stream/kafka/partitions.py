"""Exact offset ranges of several partitions read with one consumer (`_read_partitions`):
every partition assigned at once, the reads of one partition in offset order, every wait bounded."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from ckpt.stream.kafka.admin import _at
from ckpt.stream.kafka.consumer import _close_behind
from ckpt.stream.sink import SourceError

log = logging.getLogger(__name__)

_TRANSIENT = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError._RESOLVE}


class _Read(NamedTuple):
    """Offsets ``first`` through ``last`` (inclusive; None: to the end) of one partition."""

    topic: str
    partition: int
    first: int
    last: int | None


def _past(read: _Read, offset: int) -> bool:
    return read.last is not None and offset > read.last


def _read_partition(
    cconf: Mapping[str, Any],
    topic: str,
    partition: int,
    start: int,
    last: int | None,
    timeout_s: float,
    consumer: Consumer | None = None,
    keep: Callable[[Consumer], None] | None = None,
) -> Iterator[Message]:
    """Messages of one partition from ``start`` through offset ``last`` (inclusive), or to
    the end of the partition when ``last`` is None (see `_read_partitions`)."""
    reads = [_Read(topic, partition, start, last)]
    return (msg for _, msg in _read_partitions(cconf, reads, timeout_s, consumer, keep))


def _read_partitions(
    cconf: Mapping[str, Any],
    reads: Sequence[_Read],
    timeout_s: float,
    consumer: Consumer | None = None,
    keep: Callable[[Consumer], None] | None = None,
) -> Generator[tuple[int, Message], None, None]:
    """``(index into reads, message)`` for every message of every read, with one consumer:
    `consumer` (one connected ahead, closed at the end like a new one) or a new one for `cconf`.
    With `keep`, a read that served every message hands its consumer, unassigned, to `keep`
    instead of closing it (a reader that reads again soon skips a new client's connects).

    Every partition is assigned when this is called, not when the first message is asked
    for: the caller can do other work while the first fetch is in flight, and librdkafka
    fetches all partitions in the background while the caller works on what arrived.
    Messages come in offset order within a read.
    Reads of the same partition (which must not overlap) are served in offset order, whatever
    the order given: adjacent ones as one sequential read, a gap with a forward seek. A seek
    back would wait for the fetch in flight (at the end of the log, fetch.wait.max.ms) and
    then a new round trip (docs/design/kafka.md). A read to the end (``last`` None) ends at the end
    the fetch of its newest message reported, or on the end-of-partition event when there is
    nothing to read. A partition whose reads are done is paused. Raises
    ``SourceError`` when a partition ends before a read's ``last`` or nothing arrives for
    ``timeout_s``.
    """
    messages = _reading(cconf, reads, timeout_s, consumer, keep)
    next(messages, None)  # runs up to the assign (or to the end: nothing to read)
    return messages


def _reading(
    cconf: Mapping[str, Any],
    reads: Sequence[_Read],
    timeout_s: float,
    consumer: Consumer | None,
    keep: Callable[[Consumer], None] | None = None,
) -> Generator[Any, None, None]:
    """`_read_partitions`' messages, after a first None once the partitions are assigned."""
    queued = _queued_by_partition(reads)
    if not queued:
        if consumer is not None:
            consumer.close()
        return
    if consumer is None:
        consumer = Consumer(dict(cconf))
    progress = _ReadProgress(reads, queued, consumer)
    served = False
    try:
        consumer.assign(progress.assignment())
        yield None
        deadline = time.monotonic() + timeout_s
        while progress.pending:
            msg = consumer.poll(max(0.0, deadline - time.monotonic()))
            if msg is None:
                if time.monotonic() >= deadline:
                    raise progress.nothing_arrived(timeout_s)
                continue
            err = msg.error()
            if err is not None:
                progress.on_error(msg, err)
                continue
            placed = progress.place(msg)
            if placed is None:
                continue
            i, key, off = placed
            yield i, msg
            deadline = time.monotonic() + timeout_s
            progress.delivered(i, key, off)
        served = keep is not None
    finally:
        if served and keep is not None:
            consumer.resume(consumer.assignment())  # librdkafka keeps a partition's pause past a new assign
            consumer.unassign()  # the next read assigns its own offsets
            keep(consumer)
        else:
            _close_behind(consumer)


def _queued_by_partition(reads: Sequence[_Read]) -> dict[tuple[str, int], deque[int]]:
    """Indexes into `reads` per partition, in offset order (the order a partition is read in);
    the reads of one partition must not overlap."""
    by_partition: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(reads):
        by_partition.setdefault((r.topic, r.partition), []).append(i)
    queued: dict[tuple[str, int], deque[int]] = {}
    for key, ids in by_partition.items():
        ids.sort(key=lambda i: reads[i].first)
        spans = [(reads[i].first, reads[i].last) for i in ids]
        assert all(a[1] is not None and a[1] < b[0] for a, b in zip(spans, spans[1:])), f"overlapping reads {spans}"
        queued[key] = deque(ids)
    return queued


class _ReadProgress:
    """Where `_reading` stands in every partition: the reads still to serve (`pending`, the
    current one first), the offset each partition wants next, and which message of a
    partition is stale after a pause or a seek."""

    def __init__(self, reads: Sequence[_Read], pending: dict[tuple[str, int], deque[int]], consumer: Consumer) -> None:
        self.reads = reads
        self.pending = pending
        self.consumer = consumer
        self.expect = {key: reads[q[0]].first for key, q in pending.items()}  # next offset wanted
        # Just after a seek the next message must be exactly the read's first offset (a position
        # a delivery report gave): anything else was fetched before the seek.
        self.exact: set[tuple[str, int]] = set()

    def assignment(self) -> list[TopicPartition]:
        """Every partition, at the first offset of its first read."""
        return [TopicPartition(t, p, self.expect[(t, p)]) for t, p in self.pending]

    def next_read(self, key: tuple[str, int]) -> None:
        """The current read of `key` is complete: seek to its next one, or pause it."""
        q = self.pending[key]
        q.popleft()
        if not q:
            del self.pending[key]
            self.consumer.pause([TopicPartition(*key)])
        elif self.reads[q[0]].first != self.expect[key]:
            self.expect[key] = self.reads[q[0]].first
            self.exact.add(key)
            self.consumer.seek(TopicPartition(key[0], key[1], self.expect[key]))

    def stale(self, key: tuple[str, int], off: int) -> bool:
        """A message fetched before a pause or a seek of its partition."""
        return key not in self.pending or off < self.expect[key] or (key in self.exact and off != self.expect[key])

    def nothing_arrived(self, timeout_s: float) -> SourceError:
        """The error for a poll that waited `timeout_s` in vain, naming a partition still read."""
        (t, p), q = next(iter(self.pending.items()))
        last = self.reads[q[0]].last
        return SourceError(
            f"topic {t} partition {p}: nothing at offset {self.expect[(t, p)]} within "
            f"{timeout_s:g}s" + (f" (reading through offset {last})" if last is not None else "")
        )

    def on_error(self, msg: Message, err: KafkaError) -> None:
        """An event instead of a message: the end of a partition read to its end completes that
        read, a transient error or one about a partition done is ignored, anything else raises
        `SourceError`."""
        about = (msg.topic(), msg.partition())  # (None, None): an error of no partition
        if about not in self.pending:
            return  # about a partition whose reads are done
        key = cast(tuple[str, int], about)
        if err.code() == KafkaError._PARTITION_EOF:
            last = self.reads[self.pending[key][0]].last
            if last is None:
                self.next_read(key)
                return
            raise SourceError(
                f"topic {key[0]} partition {key[1]} ends at offset {msg.offset()}, but the range runs through offset {last}"
            )
        if err.code() in _TRANSIENT and not err.fatal():
            log.debug("kafka read %s[%d]: %s", key[0], key[1], err)
            return
        raise SourceError(f"topic {key[0]} partition {key[1]} at offset {self.expect[key]}: {err}")

    def place(self, msg: Message) -> tuple[int, tuple[str, int], int] | None:
        """(index of the read `msg` belongs to, its partition, its offset), or None for a stale
        message. Reads it has gone past (a gap at their end) are completed first."""
        topic, partition, off = _at(msg)
        key = (topic, partition)
        if self.stale(key, off):
            return None
        self.exact.discard(key)
        while key in self.pending and _past(self.reads[self.pending[key][0]], off):
            self.next_read(key)  # a gap (compaction/control records) at the end of a read
        if self.stale(key, off):  # the read it belonged to ended; the next one starts elsewhere
            return None
        self.exact.discard(key)
        return self.pending[key][0], key, off

    def delivered(self, i: int, key: tuple[str, int], off: int) -> None:
        """Offset `off` of read `i` was handed out: want the next one, or complete the read at its
        last offset (a read to the end: the last offset its fetch reported)."""
        self.expect[key] = off + 1
        last = self.reads[i].last
        if last is None:  # to the end: the last offset its fetch reported (negative: none yet)
            last = _fetched_end(self.consumer, key) - 1
        if 0 <= last <= off:
            self.next_read(key)


def _fetched_end(consumer: Consumer, key: tuple[str, int]) -> int:
    """The end of a partition (its high watermark) as the newest fetch of it said (negative
    before any). The end-of-partition event reports the same figure, but only with the
    answer to the next fetch (docs/design/kafka.md)."""
    return consumer.get_watermark_offsets(TopicPartition(*key), cached=True)[1]
