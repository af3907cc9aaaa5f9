"""Open the configured checkpoint backend: Kafka (default) or the filesystem.

Both give the same three pieces: a frame sink (writing), a frame source (reading exact
ranges) and the markers log. Everything in `ckpt.sink.kafka` passes through to
librdkafka untouched (SASL/TLS included, see `SinkConfig.kafka_conf`). It reads the `sink`
section, and for a restore the `restore` section, of the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from ckpt.config import RestoreConfig, SinkConfig
from ckpt.dense.ahead import DenseAhead
from ckpt.dense.store import DenseRef, DenseStore
from ckpt.log.catalog import Catalog
from ckpt.log.catalog_ahead import CatalogAhead
from ckpt.log.frames_ahead import checkpoint_to_read, read_frames_ahead
from ckpt.stream.filesystem import FsMarkers, FsSink, FsSource
from ckpt.stream.frames import file_where, kafka_where
from ckpt.stream.kafka import KafkaMarkers, KafkaSink, KafkaSource, new_admin
from ckpt.stream.sink import FrameSink, FrameSource, MarkerLog, rows_name


@dataclass
class Backend:
    sink: FrameSink
    source: FrameSource
    markers: MarkerLog
    where: str  # for messages: the broker or the directory
    locate: Callable[[int, int, int], str]  # (generation, partition, position) -> topic/file, partition, offset
    # a restore: the markers log read while the model is built (rank 0; every rank with `ckpt.restore.read_ahead`)
    ahead: CatalogAhead | None = None
    # ... and with `ckpt.restore.read_ahead`, the dense file of the checkpoint it will restore, loaded meanwhile
    dense_ahead: DenseAhead | None = None

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        self.dense_ahead = None
        for part in (self.sink, self.source, self.markers):
            part.close()


def open_sink(run_id: str, sink: SinkConfig, world_size: int, admin: AdminClient | None = None) -> FrameSink:
    """A frame sink alone; on Kafka, new generations get `world_size` partitions."""
    if sink.kind == "filesystem":
        return FsSink(Path(sink.fs_root), run_id)
    return KafkaSink(run_id, sink.kafka_conf(), num_partitions=world_size, delivery_timeout_s=sink.flush_timeout_s, admin=admin)


def open_backend(run_id: str, sink: SinkConfig, world_size: int) -> Backend:
    """Sink, source and markers for run `run_id` (`sink` resolved); nothing is created on the broker yet."""
    if sink.kind == "filesystem":
        root = Path(sink.fs_root)
        source = FsSource(root, run_id)
        return Backend(
            open_sink(run_id, sink, world_size),
            source,
            FsMarkers(root, run_id),
            str(root),
            lambda g, p, pos: file_where(source.segment_path(g, p), pos),
        )
    conf = sink.kafka_conf()
    timeout = sink.flush_timeout_s
    # one admin client for all three: fewer connections and Metadata round trips (docs/design/kafka.md, "Admin clients")
    admin = new_admin(conf)
    return Backend(
        open_sink(run_id, sink, world_size, admin),
        KafkaSource(run_id, conf, admin=admin),
        KafkaMarkers(run_id, conf, timeout_s=timeout, admin=admin),
        conf.get("bootstrap.servers", "kafka"),
        lambda g, p, pos: f"{conf.get('bootstrap.servers', 'kafka')} " + kafka_where(rows_name(run_id, g), p, pos),
    )


def open_for_restore(run_id: str, sink: SinkConfig, restore: RestoreConfig, world_size: int, rank: int) -> Backend:
    """`open_backend`, and when `restore.resume` asks for a restore, the connects of the readers
    it uses started, each on a thread of its own: the rows source on every rank, the markers
    log on rank 0, which then reads the log (`CatalogAhead`). With `ckpt.restore.read_ahead` every rank
    reads the log too and loads the dense file of the checkpoint it will restore
    (ckpt/dense/ahead.py), and on a broker starts fetching the frames it will restore
    (frames_ahead.py). A job opens it before it builds its model, so the restore finds its
    readers connected, the log read up to then, its dense state loaded and its frames fetched or
    on the way (docs/design/kafka.md, "Connecting ahead"); a connect that found no broker, or a read that failed, is tried
    again by the restore."""
    backend = open_backend(run_id, sink, world_size)
    if restore.resume == "none":
        return backend
    backend.source.prepare()
    if rank == 0:
        backend.markers.prepare(sink.connect_timeout_s)
    if rank != 0 and not restore.read_ahead:
        return backend
    backend.ahead = CatalogAhead(
        backend.markers,
        run_id,
        backend.where,
        sink.connect_timeout_s,
        catch_up=rank == 0,  # the rank that chooses the checkpoint
        then=_read_ahead(sink, restore.resume, backend, rank) if restore.read_ahead else None,
    )
    return backend


def _read_ahead(sink: SinkConfig, resume: str, backend: Backend, rank: int) -> Callable[[Catalog], None]:
    """What `ckpt.restore.read_ahead` starts once the markers log is folded (on the read's thread): the
    guessed checkpoint's dense file loaded (`backend.dense_ahead`) and, on a broker, its frames
    fetched."""
    dense = backend.dense_ahead = DenseAhead(DenseStore(Path(sink.dense_dir)))
    source, frames = backend.source, sink.kind == "kafka"

    def then(catalog: Catalog) -> None:
        marker = checkpoint_to_read(catalog, resume)
        if marker is None:
            return
        dense.start(DenseRef.from_json(marker.dense))  # first: a frames' read that fails does not stop it
        if frames:
            read_frames_ahead(marker, source, rank)

    return then
