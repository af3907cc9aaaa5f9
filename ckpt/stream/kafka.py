"""Kafka backend: frame sink, frame source and marker log (confluent-kafka).

Rows of full-checkpoint generation N live in topic ``<run>.rows.g<N>`` with one
partition per rank; markers in ``<run>.markers`` (one partition). Every librdkafka
setting passes through: ``conf`` goes to every client (bootstrap, SASL, TLS, ...),
``producer_conf`` / ``consumer_conf`` to one kind only.

Broker facts this code relies on or works around (probed on Tansu, see
``launch/broker.py``; all hold on Apache Kafka as well):

- Positions come from delivery reports, never from watermarks / ListOffsets (wrong on
  Tansu) or offsets_for_times.
- Ends of partitions are detected with ``enable.partition.eof`` (correct on Tansu,
  whose Fetch responses carry the right high watermark). Fetching past the end is
  silent on Tansu (no OFFSET_OUT_OF_RANGE), so every wait is bounded and the error
  names topic, partition and offset.
- A Metadata request naming a missing topic auto-creates it (4 partitions) on Tansu
  and on Kafka with default settings, so existence checks use the all-topics listing
  and topics are created explicitly (AdminClient) before anything is produced.
- After DeleteTopics a producer with cached metadata still gets *successful* delivery
  reports on Tansu for data that is gone: a sink refuses to write a generation it
  dropped.
- Broker loss: queued messages fail after ``delivery.timeout.ms``; an idempotent
  producer that meets a restarted (empty) broker fails fatally (UNKNOWN_PRODUCER_ID).
  Any failed flush therefore recreates the producer and re-checks topics.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from ckpt.stream.frames import Frame, FrameError, decode_frame, kafka_where
from ckpt.stream.sink import (
    RangeRead,
    RangeRecorder,
    SinkError,
    SinkResult,
    SourceError,
    TailRead,
    check_run_id,
    markers_name,
    parse_rows_name,
    rows_name,
)
from common.errors import ConfigError

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("deltarec.librdkafka")

DEFAULT_DELIVERY_TIMEOUT_S = 30.0
DEFAULT_READ_TIMEOUT_S = 30.0
# Consumers prefetch up to this much per partition (librdkafka default: 64 MiB).
DEFAULT_READ_BUFFER_KB = 16 * 1024
# Bytes one fetch may return per partition (librdkafka default: 1 MiB, about one frame, so a
# restore would wait a round trip per frame).
DEFAULT_FETCH_PARTITION_BYTES = 8 << 20
# A partition whose prefetched messages exceed the read buffer is not fetched again for this
# long (librdkafka default: 1,000 ms, which a restore that decodes slower than it fetches waited
# in full; design §6).
FETCH_QUEUE_BACKOFF_MS = 5
# Rows and markers are deleted by dropping whole topics, never by time or size:
# a base checkpoint can be older than Kafka's default retention of 7 days.
DEFAULT_TOPIC_CONFIG = {"retention.ms": "-1", "retention.bytes": "-1"}
MARKERS_FETCH_WAIT_MS = 100
# librdkafka drops a new client's bootstrap connection once Metadata names the brokers and
# connects to one of them only when the next Metadata request asks, rate-limited to one
# connect per reconnect.backoff.ms / 2 (50 ms by default; never below about 11 ms). Admin
# clients lower it (design §6); they keep sparse connections, so a broker that is down is
# retried on demand only and a new one on the same address is reached at once.
ADMIN_DEFAULTS = {"reconnect.backoff.ms": 10}
# A consumer connected ahead of a read (`_connect`) asks for the topic listing right after it
# starts. librdkafka may have dropped the bootstrap connection by then (the consumer's own first
# Metadata named the brokers), and with sparse connections the request then waits for the
# rate-limited connect, 50 ms for a consumer. Connecting to the named brokers at once avoids it;
# such a consumer lives until the next read only (design §6).
CONNECT_AHEAD_DEFAULTS = {"enable.sparse.connections": False}
_TRANSIENT = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError._RESOLVE}


def _client_conf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The settings every client of `conf` gets: `conf` itself, logging through Python's logging."""
    if "bootstrap.servers" not in conf:
        raise ConfigError("ckpt.kafka needs 'bootstrap.servers' (or set ckpt.bootstrap_servers)")
    out = dict(conf)
    out.setdefault("logger", _rdkafka_log)
    return out


def new_admin(conf: Mapping[str, Any]) -> AdminClient:
    """An AdminClient for `conf` (`ADMIN_DEFAULTS` unless `conf` sets them). A backend opens
    one and hands it to its sink, source and markers log."""
    return AdminClient({**ADMIN_DEFAULTS, **_client_conf(conf)})


def _at(msg: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a message read or delivered: the client's types allow None
    for each, which only a message that never reached a partition has."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    assert topic is not None and partition is not None and offset is not None, (topic, partition, offset)
    return topic, partition, offset


def _error_code(e: BaseException) -> Any:
    """The `KafkaError` code a `KafkaException` carries; None for any other exception."""
    err = e.args[0] if e.args else None
    return err.code() if isinstance(err, KafkaError) else None


def topic_partitions(admin: AdminClient, topic: str, timeout_s: float) -> int | None:
    """Partition count of ``topic``, or None if it does not exist.

    Uses the all-topics listing: a Metadata request naming the topic would create it.
    """
    return topics_partitions(admin, timeout_s).get(topic)


def topics_partitions(client: AdminClient | Consumer, timeout_s: float) -> dict[str, int]:
    """Partition count of every existing topic (one Metadata request, by an admin client or
    a consumer)."""
    try:
        md = client.list_topics(timeout=timeout_s)
    except KafkaException as e:
        raise SourceError(f"cannot list topics: {e.args[0]}") from None
    return {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}


def ensure_topic(
    admin: AdminClient,
    topic: str,
    partitions: int,
    *,
    replication_factor: int = -1,
    config: Mapping[str, str] | None = None,
    timeout_s: float = 10.0,
) -> int:
    """Create ``topic`` with ``partitions`` partitions unless it exists; returns its
    partition count. Raises ``SinkError``."""
    new = NewTopic(
        topic, num_partitions=partitions, replication_factor=replication_factor, config={**DEFAULT_TOPIC_CONFIG, **(config or {})}
    )
    fut = admin.create_topics([new], operation_timeout=timeout_s, request_timeout=timeout_s)[topic]
    try:
        fut.result(timeout=timeout_s + 1)
        return partitions
    except KafkaException as e:
        if _error_code(e) != KafkaError.TOPIC_ALREADY_EXISTS:
            raise SinkError(f"cannot create topic {topic}: {e.args[0]}") from None
    except Exception as e:  # noqa: BLE001 - concurrent.futures.TimeoutError, or the admin client's own errors
        raise SinkError(f"cannot create topic {topic}: {e!r}") from None
    try:
        n = topic_partitions(admin, topic, timeout_s)
    except SourceError as e:
        raise SinkError(str(e)) from None
    if n is None:
        raise SinkError(f"topic {topic} exists according to the broker but is not listed")
    return n


def drop_generation(conf: Mapping[str, Any], run_id: str, generation: int, *, timeout_s: float = 10.0) -> None:
    """Delete the rows topic of ``generation`` (missing already: fine)."""
    delete_topic(new_admin(conf), rows_name(check_run_id(run_id), generation), timeout_s)


def delete_topic(admin: AdminClient, topic: str, timeout_s: float) -> None:
    """Delete `topic` (missing already: fine); raises ``SinkError``."""
    fut = admin.delete_topics([topic], operation_timeout=timeout_s, request_timeout=timeout_s)[topic]
    try:
        fut.result(timeout=timeout_s + 1)
    except KafkaException as e:
        if _error_code(e) != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise SinkError(f"cannot delete topic {topic}: {e.args[0]}") from None
    except Exception as e:  # noqa: BLE001 - a timeout, or the admin client's own errors: one SinkError either way
        raise SinkError(f"cannot delete topic {topic}: {e!r}") from None


class _Producer:
    """An idempotent, acks=all producer that can be thrown away and recreated."""

    def __init__(
        self,
        conf: Mapping[str, Any],
        producer_conf: Mapping[str, Any] | None,
        delivery_timeout_s: float | None,
        queue_full_timeout_s: float,
    ) -> None:
        pconf = {**_client_conf(conf), **(producer_conf or {})}
        if str(pconf.get("enable.idempotence", True)).lower() not in ("true", "1"):
            raise ConfigError("ckpt.kafka: the checkpoint producer needs enable.idempotence=true")
        if str(pconf.get("acks", "all")).lower() not in ("all", "-1"):
            raise ConfigError("ckpt.kafka: the checkpoint producer needs acks=all")
        pconf["enable.idempotence"] = True
        pconf["acks"] = "all"
        if delivery_timeout_s is not None or "delivery.timeout.ms" not in pconf:
            pconf["delivery.timeout.ms"] = int(1000 * (delivery_timeout_s or DEFAULT_DELIVERY_TIMEOUT_S))
        self._conf = pconf
        self.queue_full_timeout_s = queue_full_timeout_s
        self._producer: Producer | None = self._new()

    @property
    def producer(self) -> Producer:
        """The client (after `close`, none: an AssertionError says so)."""
        assert self._producer is not None, "the checkpoint producer is closed"
        return self._producer

    def _new(self) -> Producer:
        # The fatal error goes to a holder, not to self: no reference cycle, so a
        # dropped sink's client (and its connections) goes away at once.
        self._fatal: list[KafkaError] = []

        def on_error(err: KafkaError, fatal: list = self._fatal) -> None:
            if err.fatal():
                fatal.append(err)
            log.debug("kafka producer: %s", err)

        return Producer({**self._conf, "error_cb": on_error})

    def produce(
        self, topic: str, value: bytes, partition: int, on_delivery: Callable[[KafkaError | None, Message], None]
    ) -> None:
        """Queue one message; on a full local queue serve callbacks and retry (bounded)."""
        deadline = None
        while True:
            try:
                self.producer.produce(topic, value, partition=partition, on_delivery=on_delivery)
                break
            except BufferError:
                now = time.monotonic()
                deadline = deadline or now + self.queue_full_timeout_s
                if now >= deadline:
                    raise SinkError(f"producer queue for {topic} stayed full for {self.queue_full_timeout_s:.0f}s") from None
                self.producer.poll(min(0.1, deadline - now))
            except KafkaException as e:
                raise SinkError(f"cannot produce to {topic} partition {partition}: {e.args[0]}") from None
        self.producer.poll(0)

    def flush(self, timeout_s: float) -> SinkError | None:
        """Wait for every queued message's delivery report; an error if not all came."""
        try:
            left = self.producer.flush(timeout_s)
        except KafkaException as e:  # fatal producer error
            return SinkError(f"producer failed: {e.args[0]}")
        if self._fatal:
            return SinkError(f"producer failed: {self._fatal[0]}")
        if left:
            return SinkError(f"flush timed out after {timeout_s:g}s with {left} message(s) unacknowledged")
        return None

    def recreate(self) -> None:
        old = self.producer
        try:
            old.purge(in_queue=True, in_flight=True, blocking=False)
            old.poll(0)  # serve the purge reports (callbacks ignore stale epochs)
        except Exception:  # noqa: BLE001 - a client being replaced: whatever it raises, the new one takes over
            pass
        self._producer = self._new()

    def close(self) -> None:
        if self._producer is None:
            return
        try:
            self._producer.purge(in_queue=True, in_flight=True, blocking=False)
            self._producer.poll(0)
        except Exception:  # noqa: BLE001 - closing: the client is dropped whatever it raises
            pass
        self._producer = None  # destroys the client: its connections close now


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


def _consumer_conf(
    conf: Mapping[str, Any], consumer_conf: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    # A fetch at the end of a partition waits fetch.wait.max.ms before the broker
    # answers (and we learn it is the end): keep that short for readers. These and the
    # reader's `defaults` are defaults: a setting of `ckpt.kafka` (in `conf`) wins.
    c = {
        "queued.max.messages.kbytes": DEFAULT_READ_BUFFER_KB,
        "max.partition.fetch.bytes": DEFAULT_FETCH_PARTITION_BYTES,
        "fetch.wait.max.ms": 10,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        **(defaults or {}),
        **_client_conf(conf),
        **(consumer_conf or {}),
    }
    # assign()-only reading: a throwaway group id (confluent-kafka insists on one),
    # never committed; start offsets are always explicit.
    c.update(
        {
            "group.id": f"deltarec-reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
            "error_cb": lambda err: log.debug("kafka consumer: %s", err),
        }
    )
    return c


class _ConnectedConsumer(NamedTuple):
    """A new consumer whose first request, the all-topics listing, has been answered: it is
    connected, and `topics` says what existed then (partition counts). `watermarks`: the
    (low, high) ListOffsets answer for the partition `_connect` was asked about, if any."""

    consumer: Consumer
    topics: dict[str, int]
    watermarks: tuple[int, int] | None = None


def _connect(cconf: Mapping[str, Any], timeout_s: float, watermarks_of: TopicPartition | None = None) -> _ConnectedConsumer:
    """A consumer for `cconf`, connected by the all-topics listing (closed again, and the
    `KafkaException` raised, if nothing answers within `timeout_s`); with `watermarks_of`,
    that partition's watermarks too when its topic exists."""
    consumer = Consumer({**CONNECT_AHEAD_DEFAULTS, **cconf})
    try:
        md = consumer.list_topics(timeout=timeout_s)
        topics = {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}
        marks = None
        if watermarks_of is not None and watermarks_of.topic in topics:
            marks = consumer.get_watermark_offsets(watermarks_of, timeout=timeout_s, cached=False)
    except BaseException:
        consumer.close()
        raise
    return _ConnectedConsumer(consumer, topics, marks)


class _ConnectAhead:
    """The slot for at most one consumer connected ahead of its owner's next read: `put` a
    pending or finished connect, `take` it once, `close` closes one nobody took. A reader that
    takes none connects as before; one that takes one skips a new client's connects (design §6).
    Thread-safe: a source is read from several threads, and a prepare connects on its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Future[_ConnectedConsumer] | None = None

    def put(self, pending: Future[_ConnectedConsumer]) -> None:
        with self._lock:
            old, self._held = self._held, pending
        _close_connected(old)

    def take(self) -> _ConnectedConsumer | None:
        """The consumer connected ahead, once its connect is done, or None if none was put;
        raises what its connect raised (`KafkaException`: nothing answered)."""
        with self._lock:
            held, self._held = self._held, None
        return None if held is None else held.result()

    def take_connected(self) -> _ConnectedConsumer | None:
        """`take`, but None also when the connect found no broker: one may answer now, so the
        read connects again and meets a failure with its own message."""
        try:
            return self.take()
        except KafkaException:
            return None

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, None
        _close_connected(held)


def _close_connected(pending: Future[_ConnectedConsumer] | None) -> None:
    """Close the consumer of `pending` once its connect is done (now, if it is)."""

    def close(done: Future[_ConnectedConsumer]) -> None:
        if done.exception() is None:
            done.result().consumer.close()

    if pending is not None:
        pending.add_done_callback(close)


def _connect_on_thread(
    cconf: Mapping[str, Any], timeout_s: float, watermarks_of: TopicPartition | None = None
) -> Future[_ConnectedConsumer]:
    """`_connect` on a thread of its own (librdkafka waits without holding the GIL). A daemon
    thread, not an executor's: a process that exits does not wait out a connect to a broker
    that is down."""
    pending: Future[_ConnectedConsumer] = Future()

    def run() -> None:
        try:
            pending.set_result(_connect(cconf, timeout_s, watermarks_of))
        except BaseException as exc:  # noqa: BLE001 - raised to whoever takes the consumer
            pending.set_exception(exc)

    threading.Thread(target=run, name="deltarec-kafka-connect", daemon=True).start()
    return pending


def _topics_for(ready: _ConnectedConsumer | None, admin: AdminClient, needed: Sequence[str], timeout_s: float) -> dict[str, int]:
    """The topics a read checks `needed` against: the admin client's listing without a consumer
    connected ahead (`ready`); its listing while that names them all, else it lists again (a
    topic created since must not look missing; one deleted since fails its read). A `ready`
    consumer whose listing fails is closed."""
    if ready is None:
        return topics_partitions(admin, timeout_s)
    if all(t in ready.topics for t in needed):
        return ready.topics
    try:
        return topics_partitions(ready.consumer, timeout_s)
    except BaseException:
        ready.consumer.close()
        raise


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
) -> Iterator[Message]:
    """Messages of one partition from ``start`` through offset ``last`` (inclusive), or to
    the end of the partition when ``last`` is None (see `_read_partitions`)."""
    return (msg for _, msg in _read_partitions(cconf, [_Read(topic, partition, start, last)], timeout_s, consumer))


def _read_partitions(
    cconf: Mapping[str, Any], reads: Sequence[_Read], timeout_s: float, consumer: Consumer | None = None
) -> Iterator[tuple[int, Message]]:
    """``(index into reads, message)`` for every message of every read, with one consumer:
    `consumer` (one connected ahead, closed at the end like a new one) or a new one for `cconf`.

    Every partition is assigned when this is called, not when the first message is asked
    for: the caller can do other work while the first fetch is in flight, and librdkafka
    fetches all partitions in the background while the caller works on what arrived.
    Messages come in offset order within a read.
    Reads of the same partition (which must not overlap) are served in offset order, whatever
    the order given: adjacent ones as one sequential read, a gap with a forward seek. A seek
    back would wait for the fetch in flight (at the end of the log, fetch.wait.max.ms) and
    then a new round trip (design §6). A read to the end (``last`` None) ends at the end
    the fetch of its newest message reported, or on the end-of-partition event when there is
    nothing to read. A partition whose reads are done is paused. Raises
    ``SourceError`` when a partition ends before a read's ``last`` or nothing arrives for
    ``timeout_s``.
    """
    messages = _reading(cconf, reads, timeout_s, consumer)
    next(messages, None)  # runs up to the assign (or to the end: nothing to read)
    return messages


def _reading(cconf: Mapping[str, Any], reads: Sequence[_Read], timeout_s: float, consumer: Consumer | None) -> Iterator[Any]:
    """`_read_partitions`' messages, after a first None once the partitions are assigned."""
    queued = _queued_by_partition(reads)
    if not queued:
        if consumer is not None:
            consumer.close()
        return
    if consumer is None:
        consumer = Consumer(dict(cconf))
    progress = _ReadProgress(reads, queued, consumer)
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
    finally:
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
    answer to the next fetch (design §6)."""
    return consumer.get_watermark_offsets(TopicPartition(*key), cached=True)[1]


def _close_behind(consumer: Consumer) -> None:
    """Close `consumer` on a thread of its own: the close waits for librdkafka's threads to
    wind down (a few ms), which a read that has all its messages need not wait for."""
    threading.Thread(target=consumer.close, name="deltarec-kafka-close").start()


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


class BrokerUnreachable(SinkError):
    """No broker answered a metadata request within ``ckpt.connect_timeout_s``."""


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
        # of a long log with nothing when its own work takes longer than that (design §6).
        self._cconf = {
            **_consumer_conf(conf, consumer_conf, {"fetch.wait.max.ms": MARKERS_FETCH_WAIT_MS}),
            "auto.offset.reset": "earliest",
        }
        self._topic_ok = False
        self._last: int | None = None  # offset of our own last append
        self._closed = False
        self._connect_ahead = _ConnectAhead()  # the consumer `check_reachable` connected, for the next read

    def append_marker(self, payload: bytes) -> int:
        if self._closed:
            raise SinkError("marker log is closed")
        if not self._topic_ok:
            n = ensure_topic(self._admin, self.topic, 1, replication_factor=self.replication_factor, timeout_s=self.timeout_s)
            if n != 1:
                raise SinkError(f"marker topic {self.topic} has {n} partitions, expected 1")
            self._topic_ok = True
        box: list = []
        self._p.produce(self.topic, payload, 0, lambda err, msg: box.append((err, msg)))
        err = self._p.flush(self.timeout_s)
        if err is None and box and box[0][0] is not None:
            err = SinkError(f"marker delivery to {self.topic} failed: {box[0][0]}")
        if err is None and not box:
            err = SinkError(f"no delivery report for the marker on {self.topic}")
        if err is not None:
            self._p.recreate()
            self._topic_ok = False
            raise err
        self._last = box[0][1].offset()
        return self._last

    def prepare(self, timeout_s: float) -> None:
        """Start `check_reachable`'s connect on a thread of its own (the checkpoint manager
        does while it is being built, so a restore finds the markers reader connected), and
        ask for the log's watermarks there, which `read_tail` then starts from."""
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
                f"no Kafka broker answered at {self.bootstrap} within {timeout_s:g} s (ckpt.connect_timeout_s): "
                f"{reason}; start it (deltarec-broker start) or fix ckpt.bootstrap_servers"
            ) from None
        done: Future[_ConnectedConsumer] = Future()
        done.set_result(connected)
        self._connect_ahead.put(done)

    def read_markers(self, start: int = 0, *, timeout_s: float | None = None) -> list[tuple[int, bytes]]:
        """The markers from offset `start` to the end of the topic, as its fetches report it
        (a ListOffsets watermark is not trusted: launch/broker.py). No topic yet: no markers."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        ready = self._connect_ahead.take_connected()
        if not self._topic_exists(ready, timeout_s):
            return []
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

    def _read_from(self, start: int, consumer: Consumer | None, timeout_s: float) -> list[tuple[int, bytes]]:
        out = [
            (_at(m)[2], m.value() or b"") for m in _read_partition(self._cconf, self.topic, 0, start, None, timeout_s, consumer)
        ]
        if self._last is not None and self._last >= start and (not out or out[-1][0] < self._last):
            raise SourceError(f"marker topic {self.topic} ends before offset {self._last}, which this process appended")
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._connect_ahead.close()
            self._p.close()
            del self._admin  # the client goes now (its connections close)
