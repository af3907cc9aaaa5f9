"""`KafkaMarkers`: the marker log, topic ``<run>.markers`` (one partition, synchronous appends),
and `BrokerUnreachable`, its reachability check's error."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from ckpt.stream.kafka.admin import _at, ensure_topic, new_admin
from ckpt.stream.kafka.consumer import (
    _connect,
    _connect_on_thread,
    _ConnectAhead,
    _ConnectedConsumer,
    _consumer_conf,
    _topics_for,
)
from ckpt.stream.kafka.partitions import _read_partition
from ckpt.stream.kafka.producer import DEFAULT_DELIVERY_TIMEOUT_S, _Producer
from ckpt.stream.sink import SinkError, SourceError, TailRead, check_run_id, markers_name

MARKERS_FETCH_WAIT_MS = 100
#: fetch.wait.max.ms of the consumer kept for reads of the log's tail (`read_markers` after the
#: first): a read on a reused consumer waits out the fetch its last read left in flight.
TAIL_FETCH_WAIT_MS = 10


def _box_reports(box: list[tuple[Any, Any]]) -> Callable[[Any, Any], None]:
    """A delivery callback that keeps its (error, message) in `box`."""

    def report(err: Any, msg: Any) -> None:
        box.append((err, msg))

    return report


class BrokerUnreachable(SinkError):
    """No broker answered a metadata request within ``ckpt.sink.connect_timeout_s``."""


class KafkaMarkers:
    """The marker log: topic ``<run>.markers``, one partition, synchronous appends."""

    def __init__(
        self,
        run_id: str,
        conf: Mapping[str, Any],
        *,
        producer_conf: Mapping[str, Any] | None = None,
        consumer_conf: Mapping[str, Any] | None = None,
        replication_factor: int = -1,
        timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        admin: AdminClient | None = None,
    ) -> None:
        self.run_id = check_run_id(run_id)
        self.topic = markers_name(self.run_id)
        self.timeout_s = timeout_s
        self.replication_factor = replication_factor
        self._admin = admin or new_admin(conf)
        self.bootstrap = str(conf.get("bootstrap.servers", "kafka"))
        self._p = _Producer(conf, producer_conf, timeout_s, timeout_s)
        # Read from offset 0, or from the earliest kept offset if retention removed it
        # (OFFSET_BEGINNING would cost an extra ListOffsets round, ~0.5 s on Tansu). A read
        # to the end stops where its last fetch said the log ends, so fetch.wait.max.ms
        # delays only a read with nothing to read; and the embedded broker answers a fetch
        # of a long log with nothing when its own work takes longer than that (docs/design/kafka.md).
        self._cconf = {
            **_consumer_conf(conf, consumer_conf, {"fetch.wait.max.ms": MARKERS_FETCH_WAIT_MS}),
            "auto.offset.reset": "earliest",
        }
        self._topic_ok = False
        self._last: int | None = None  # offset of our own last append
        self._closed = False
        self._connect_ahead = _ConnectAhead()  # the consumer `check_reachable` connected, for the next read
        # After a first `read_markers` found the topic, the later ones read its tail with one
        # consumer kept between them: a committer reads the log before every commit, and a new
        # client each time costs its connects and an all-topics listing, here and on the broker.
        self._tail_cconf = {**self._cconf, "fetch.wait.max.ms": TAIL_FETCH_WAIT_MS}
        self._found = False  # a read found the topic
        self._kept: Consumer | None = None  # the tail reader, between two reads
        self._kept_lock = threading.Lock()

    def append_marker(self, payload: bytes) -> int:
        return self.append_markers([payload])[0]

    def append_markers(self, payloads: Sequence[bytes]) -> list[int]:
        """Produce every record, then one flush: the idempotent producer keeps their order
        within the partition, and they usually travel in one request."""
        if self._closed:
            raise SinkError("marker log is closed")
        if not self._topic_ok:
            n = ensure_topic(self._admin, self.topic, 1, replication_factor=self.replication_factor, timeout_s=self.timeout_s)
            if n != 1:
                raise SinkError(f"marker topic {self.topic} has {n} partitions, expected 1")
            self._topic_ok = True
        reports: list[list[tuple[Any, Any]]] = [[] for _ in payloads]
        for payload, box in zip(payloads, reports):
            self._p.produce(self.topic, payload, 0, _box_reports(box))
        err = self._p.flush(self.timeout_s)
        for box in reports:
            if err is not None:
                break
            if not box:
                err = SinkError(f"no delivery report for a marker on {self.topic}")
            elif box[0][0] is not None:
                err = SinkError(f"marker delivery to {self.topic} failed: {box[0][0]}")
        if err is not None:
            self._p.recreate()
            self._topic_ok = False
            raise err
        positions = [int(box[0][1].offset()) for box in reports]
        self._last = positions[-1]
        return positions

    def prepare(self, timeout_s: float) -> None:
        """Start `check_reachable`'s connect on a thread of its own (the checkpointer
        does while it is being built, so a restore finds the markers reader connected), and
        ask for the log's watermarks there, which `read_tail` then starts from. After a read
        found the topic: the tail reader the next `read_markers` uses, if none is kept (a new
        client connects in the background from here)."""
        if self._found:
            with self._kept_lock:
                if self._kept is None and not self._closed:
                    self._kept = Consumer(dict(self._tail_cconf))
            return
        self._connect_ahead.put(_connect_on_thread(self._cconf, timeout_s, TopicPartition(self.topic, 0)))

    def check_reachable(self, timeout_s: float) -> None:
        """One metadata request, bounded by `timeout_s` from this call (the one `prepare` started,
        if any, and a new one if that found no broker);
        ``BrokerUnreachable`` naming the address and librdkafka's reason when nothing answers
        (refused, unresolvable, silent). It is the first request of the consumer the next
        `read_markers` reads with."""
        deadline = time.monotonic() + timeout_s
        try:
            try:
                connected = self._connect_ahead.take()
            except KafkaException:
                # the connect `prepare` started (maybe long ago) found no broker: ask again
                # for what is left of `timeout_s` from now, so a broker that came up since answers
                connected = None
                if time.monotonic() >= deadline:
                    raise
            connected = connected or _connect(self._cconf, max(deadline - time.monotonic(), 0.001))
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            reason = err.str() if isinstance(err, KafkaError) else str(exc)
            raise BrokerUnreachable(
                f"no Kafka broker answered at {self.bootstrap} within {timeout_s:g} s (ckpt.sink.connect_timeout_s): "
                f"{reason}; start it (deltarec-broker start) or fix ckpt.sink.bootstrap_servers"
            ) from None
        done: Future[_ConnectedConsumer] = Future()
        done.set_result(connected)
        self._connect_ahead.put(done)

    def read_markers(self, start: int = 0, *, timeout_s: float | None = None) -> list[tuple[int, bytes]]:
        """The markers from offset `start` to the end of the topic, as its fetches report it
        (a ListOffsets watermark is not trusted: launch/broker.py). No topic yet: no markers."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._found:  # the topic was there: one deleted since fails this read
            with self._kept_lock:
                kept, self._kept = self._kept, None
            return self._read_from(start, kept or Consumer(dict(self._tail_cconf)), timeout_s, keep=True)
        ready = self._connect_ahead.take_connected()
        if not self._topic_exists(ready, timeout_s):
            return []
        self._found = True
        return self._read_from(start, ready.consumer if ready else None, timeout_s)

    def read_tail(self, records: int, *, timeout_s: float | None = None) -> TailRead:
        """The markers from `records` before the end to the end. The start comes from a
        ListOffsets watermark (one round trip), which the embedded broker may under-report
        (launch/broker.py): that only starts the read earlier. The read itself ends where
        the fetches say, as `read_markers` does."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        ready = self._connect_ahead.take_connected()
        if not self._topic_exists(ready, timeout_s):
            return TailRead([], True)
        consumer = ready.consumer if ready else None
        try:
            consumer = consumer or _connect(self._cconf, timeout_s).consumer
            # the connect `prepare` started asked already: the log has only grown since
            # (a start too early reads more, never less)
            low, high = (
                ready.watermarks
                if ready is not None and ready.watermarks is not None
                else consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=timeout_s, cached=False)
            )
        except KafkaException as exc:
            if consumer is not None:
                consumer.close()
            raise SourceError(f"marker topic {self.topic}: no watermarks from {self.bootstrap}: {exc}") from None
        start = max(low, high - records, 0)
        return TailRead(self._read_from(start, consumer, timeout_s), start <= low)

    def _topic_exists(self, ready: _ConnectedConsumer | None, timeout_s: float) -> bool:
        """Whether the markers topic exists (no topic: no markers yet); a topic gone after
        this process appended to it is an error. A `ready` consumer not used for a read is closed."""
        if self.topic in _topics_for(ready, self._admin, [self.topic], timeout_s):
            return True
        if ready is not None:
            ready.consumer.close()
        if self._last is not None:
            raise SourceError(f"marker topic {self.topic} is gone (we appended offset {self._last})")
        return False

    def _read_from(self, start: int, consumer: Consumer | None, timeout_s: float, keep: bool = False) -> list[tuple[int, bytes]]:
        """The markers from `start` to the end; with `keep`, the consumer is kept for the next
        `read_markers` once it read to the end."""
        messages = _read_partition(self._cconf, self.topic, 0, start, None, timeout_s, consumer, self._keep if keep else None)
        out = [(_at(m)[2], m.value() or b"") for m in messages]
        if self._last is not None and self._last >= start and (not out or out[-1][0] < self._last):
            raise SourceError(f"marker topic {self.topic} ends before offset {self._last}, which this process appended")
        return out

    def _keep(self, consumer: Consumer) -> None:
        """Keep `consumer` (the tail reader) for the next `read_markers`; closed instead once the log is."""
        with self._kept_lock:
            old, closed = self._kept, self._closed
            self._kept = None if closed else consumer
        if old is not None:
            old.close()
        if closed:
            consumer.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._kept_lock:
                kept, self._kept = self._kept, None
            if kept is not None:
                kept.close()
            self._connect_ahead.close()
            self._p.close()
            del self._admin  # the client goes now (its connections close)
