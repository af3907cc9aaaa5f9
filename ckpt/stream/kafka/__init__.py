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

One module per job, each importing only modules listed above it:

- ``admin``: the settings every client gets, the admin client, topics listed, created and deleted;
- ``producer``: the idempotent, acks=all producer the sink and the marker log append with;
- ``sink``: ``KafkaSink``, frames to a generation's rows topic;
- ``consumer``: reader settings, consumers connected ahead of a read (``_ConnectAhead``);
- ``partitions``: one consumer reading exact offset ranges of several partitions;
- ``decoded_ahead``: a read ahead's frames decoded on a thread while the model is built;
- ``source``: ``KafkaSource``, frames read back by offset range;
- ``markers``: ``KafkaMarkers``, the marker log, and ``BrokerUnreachable``.
"""

from __future__ import annotations

from ckpt.stream.kafka.admin import (
    ADMIN_DEFAULTS,
    DEFAULT_TOPIC_CONFIG,
    delete_topic,
    drop_generation,
    ensure_topic,
    new_admin,
    topic_partitions,
    topics_partitions,
)
from ckpt.stream.kafka.consumer import (
    CONNECT_AHEAD_DEFAULTS,
    DEFAULT_FETCH_PARTITION_BYTES,
    DEFAULT_READ_BUFFER_KB,
    FETCH_QUEUE_BACKOFF_MS,
)
from ckpt.stream.kafka.markers import MARKERS_FETCH_WAIT_MS, BrokerUnreachable, KafkaMarkers
from ckpt.stream.kafka.producer import DEFAULT_DELIVERY_TIMEOUT_S
from ckpt.stream.kafka.sink import KafkaSink
from ckpt.stream.kafka.source import DEFAULT_READ_TIMEOUT_S, KafkaSource

__all__ = [
    "ADMIN_DEFAULTS",
    "CONNECT_AHEAD_DEFAULTS",
    "DEFAULT_DELIVERY_TIMEOUT_S",
    "DEFAULT_FETCH_PARTITION_BYTES",
    "DEFAULT_READ_BUFFER_KB",
    "DEFAULT_READ_TIMEOUT_S",
    "DEFAULT_TOPIC_CONFIG",
    "FETCH_QUEUE_BACKOFF_MS",
    "MARKERS_FETCH_WAIT_MS",
    "BrokerUnreachable",
    "KafkaMarkers",
    "KafkaSink",
    "KafkaSource",
    "delete_topic",
    "drop_generation",
    "ensure_topic",
    "new_admin",
    "topic_partitions",
    "topics_partitions",
]
