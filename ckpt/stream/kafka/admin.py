"""The settings every Kafka client gets, the admin client, and topics: listed, created, deleted.
Also `_at`, a message's (topic, partition, offset), which the other modules use as well."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message
from confluent_kafka.admin import AdminClient, NewTopic

from ckpt.stream.sink import SinkError, SourceError, check_run_id, rows_name
from common.errors import ConfigError

_rdkafka_log = logging.getLogger("deltarec.librdkafka")

# Rows and markers are deleted by dropping whole topics, never by time or size:
# a base checkpoint can be older than Kafka's default retention of 7 days.
DEFAULT_TOPIC_CONFIG = {"retention.ms": "-1", "retention.bytes": "-1"}
# librdkafka drops a new client's bootstrap connection once Metadata names the brokers and
# connects to one of them only when the next Metadata request asks, rate-limited to one
# connect per reconnect.backoff.ms / 2 (50 ms by default; never below about 11 ms). Admin
# clients lower it (docs/design/kafka.md); they keep sparse connections, so a broker that is down is
# retried on demand only and a new one on the same address is reached at once.
ADMIN_DEFAULTS = {"reconnect.backoff.ms": 10}


def _client_conf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The settings every client of `conf` gets: `conf` itself, logging through Python's logging."""
    if "bootstrap.servers" not in conf:
        raise ConfigError("ckpt.sink.kafka needs 'bootstrap.servers' (or set ckpt.sink.bootstrap_servers)")
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
