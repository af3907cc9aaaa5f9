"""Reader consumers: their settings (`_consumer_conf`), a consumer connected ahead of its read
(`_connect`, `_ConnectAhead`, docs/design/kafka.md), the topics a read checks against, and the close that
does not keep a read waiting."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from ckpt.stream.kafka.admin import _client_conf, topics_partitions

log = logging.getLogger(__name__)

# Consumers prefetch up to this much per partition (librdkafka default: 64 MiB).
DEFAULT_READ_BUFFER_KB = 16 * 1024
# Bytes one fetch may return per partition (librdkafka default: 1 MiB, about one frame, so a
# restore would wait a round trip per frame).
DEFAULT_FETCH_PARTITION_BYTES = 8 << 20
# A partition whose prefetched messages exceed the read buffer is not fetched again for this
# long (librdkafka default: 1,000 ms, which a restore that decodes slower than it fetches waited
# in full; docs/design/kafka.md).
FETCH_QUEUE_BACKOFF_MS = 5
# A consumer connected ahead of a read (`_connect`) asks for the topic listing right after it
# starts. librdkafka may have dropped the bootstrap connection by then (the consumer's own first
# Metadata named the brokers), and with sparse connections the request then waits for the
# rate-limited connect, 50 ms for a consumer. Connecting to the named brokers at once avoids it;
# such a consumer lives until the next read only (docs/design/kafka.md).
CONNECT_AHEAD_DEFAULTS = {"enable.sparse.connections": False}


def _consumer_conf(
    conf: Mapping[str, Any], consumer_conf: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    # A fetch at the end of a partition waits fetch.wait.max.ms before the broker
    # answers (and we learn it is the end): keep that short for readers. These and the
    # reader's `defaults` are defaults: a setting of `ckpt.sink.kafka` (in `conf`) wins.
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
    takes none connects as before; one that takes one skips a new client's connects (docs/design/kafka.md).
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


def _close_behind(consumer: Consumer) -> None:
    """Close `consumer` on a thread of its own: the close waits for librdkafka's threads to
    wind down (a few ms), which a read that has all its messages need not wait for."""
    threading.Thread(target=consumer.close, name="deltarec-kafka-close").start()
