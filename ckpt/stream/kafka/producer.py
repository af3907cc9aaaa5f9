"""The checkpoint producer (`_Producer`): idempotent, acks=all, thrown away and recreated after
a failed flush. The rows sink (`ckpt.stream.kafka.sink`) and the marker log
(`ckpt.stream.kafka.markers`) append with it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from ckpt.stream.kafka.admin import _client_conf
from ckpt.stream.sink import SinkError
from common.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_DELIVERY_TIMEOUT_S = 30.0

# librdkafka's idempotent producer keeps at most 5 messages of a partition in flight
# (RD_KAFKA_IDEMP_MAX_INFLIGHT); while one more waits behind them its broker thread polls its
# sockets with a zero timeout until a reply comes, a busy loop as long as the broker takes
# (docs/design/kafka.md, "At most 5 messages outstanding"). `produce` therefore waits, serving
# delivery reports, while this many messages are queued or in flight.
MAX_OUTSTANDING = 5
# ... but not for a broker that answers nothing: after this long without a delivery report it
# queues without waiting until the next flush, so a dead broker fails a flush as before, this
# much later at most.
OUTSTANDING_STALL_S = 1.0


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
            raise ConfigError("ckpt.sink.kafka: the checkpoint producer needs enable.idempotence=true")
        if str(pconf.get("acks", "all")).lower() not in ("all", "-1"):
            raise ConfigError("ckpt.sink.kafka: the checkpoint producer needs acks=all")
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
        self._unbounded = False  # the broker stalled: queue without waiting until the next flush

        def on_error(err: KafkaError, fatal: list = self._fatal) -> None:
            if err.fatal():
                fatal.append(err)
            log.debug("kafka producer: %s", err)

        return Producer({**self._conf, "error_cb": on_error})

    def produce(
        self, topic: str, value: bytes, partition: int, on_delivery: Callable[[KafkaError | None, Message], None]
    ) -> None:
        """Queue one message, once fewer than `MAX_OUTSTANDING` are queued or in flight; on a
        full local queue serve callbacks and retry (bounded)."""
        self._wait_for_room()
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

    def _wait_for_room(self) -> None:
        """Serve delivery reports while `MAX_OUTSTANDING` messages are queued or in flight,
        for at most `OUTSTANDING_STALL_S` without one arriving (then stop waiting until the
        next flush: the broker is stalled or gone, and the flush reports it)."""
        producer = self.producer
        outstanding = len(producer)
        stalled_at = time.monotonic() + OUTSTANDING_STALL_S
        while outstanding >= MAX_OUTSTANDING and not self._unbounded:
            producer.poll(0.1)
            now, left = time.monotonic(), len(producer)
            if left < outstanding:
                stalled_at = now + OUTSTANDING_STALL_S
            elif now >= stalled_at:
                log.debug("kafka producer: no delivery report for %.1fs; queueing without waiting", OUTSTANDING_STALL_S)
                self._unbounded = True
            outstanding = left

    def flush(self, timeout_s: float) -> SinkError | None:
        """Wait for every queued message's delivery report; an error if not all came."""
        self._unbounded = False
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
