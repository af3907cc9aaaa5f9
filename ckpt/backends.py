"""Open the configured checkpoint backend: Kafka (default) or the filesystem.

Both give the same three pieces: a frame sink (writing), a frame source (reading exact
ranges) and the markers log. Everything in `ckpt.kafka` passes through to librdkafka
untouched (SASL/TLS included); `ckpt.bootstrap_servers` is a shortcut for
`bootstrap.servers`, whose dots a command-line override cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ckpt.frames import file_where, kafka_where
from ckpt.fs_sink import FsMarkers, FsSink, FsSource
from ckpt.kafka_sink import KafkaMarkers, KafkaSink, KafkaSource
from ckpt.sink import FrameSink, FrameSource, MarkerLog, rows_name
from trainer.config import JobConfig


@dataclass
class Backend:
    sink: FrameSink
    source: FrameSource
    markers: MarkerLog
    where: str  # for messages: the broker or the directory
    locate: Callable[[int, int, int], str]  # (generation, partition, position) -> topic/file, partition, offset

    def close(self) -> None:
        for part in (self.sink, self.source, self.markers):
            part.close()


def run_id_of(cfg: JobConfig) -> str:
    return cfg.ckpt.run_id or cfg.run.name


def kafka_conf(cfg: JobConfig) -> dict[str, Any]:
    conf = {str(k): v for k, v in cfg.ckpt.kafka.items()}
    if cfg.ckpt.bootstrap_servers:
        conf["bootstrap.servers"] = cfg.ckpt.bootstrap_servers
    return conf


def fs_root(cfg: JobConfig) -> Path:
    return Path(cfg.ckpt.fs_root) if cfg.ckpt.fs_root else cfg.run.run_dir / "stream"


def dense_dir(cfg: JobConfig) -> Path:
    return Path(cfg.ckpt.dense_dir) if cfg.ckpt.dense_dir else cfg.run.run_dir / "dense"


def open_backend(cfg: JobConfig, world_size: int) -> Backend:
    """Sink, source and markers for this run; nothing is created on the broker yet."""
    run_id = run_id_of(cfg)
    if cfg.ckpt.sink == "filesystem":
        root = fs_root(cfg)
        source = FsSource(root, run_id)
        return Backend(
            FsSink(root, run_id), source, FsMarkers(root, run_id), str(root),
            lambda g, p, pos: file_where(source.segment_path(g, p), pos),
        )
    conf = kafka_conf(cfg)
    timeout = cfg.ckpt.flush_timeout_s
    return Backend(
        KafkaSink(run_id, conf, num_partitions=world_size, delivery_timeout_s=timeout),
        KafkaSource(run_id, conf),
        KafkaMarkers(run_id, conf, timeout_s=timeout),
        conf.get("bootstrap.servers", "kafka"),
        lambda g, p, pos: f"{conf.get('bootstrap.servers', 'kafka')} " + kafka_where(rows_name(run_id, g), p, pos),
    )
