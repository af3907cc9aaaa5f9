"""The `ckpt` config section: continuous checkpointing, read only by the checkpoint code.

`trainer/config.py` builds it from the job's YAML and fills the run-derived defaults
(`run_id`, `fs_root`, `dense_dir`) with `resolved`, so nothing under ckpt/ needs the rest of
the job config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ckpt.follow.config import FollowConfig
from ckpt.quant import CHECK_N_RUN_WIDTHS, check_widths, codec_names, get_codec
from ckpt.sink import check_run_id
from common.errors import ConfigError


def _check_n_run_widths() -> list[list[int]]:
    return [list(pair) for pair in CHECK_N_RUN_WIDTHS]


REDACTED = "<redacted>"
# librdkafka settings that hold a secret: passwords, client secrets, private keys, OAuth configs.
_SECRET_WORDS = ("password", "secret", "ssl.key.pem", "oauthbearer.config", "keystore")


def _is_secret(name: str) -> bool:
    return any(word in name for word in _SECRET_WORDS)


@dataclass
class CkptConfig:
    """Continuous checkpointing: where rows go, how often, which rows, how encoded."""

    enabled: bool = False
    sink: Literal["kafka", "filesystem"] = "kafka"
    run_id: str = ""  # default: run.name; names the Kafka topics / segment directories
    policy: Literal["full", "one_shot_diff", "incremental", "intermittent_diff"] = "intermittent_diff"
    interval_steps: int = 100  # 0: only by time
    interval_s: float = 0.0  # 0: only by steps; else rank 0's clock, checked every 10 steps
    encoding: str = "fp32"  # weight rows codec (ckpt/quant: fp32, fp16, asym8, adaptive4, ...)
    optimizer_encoding: str = "fp32"  # optimizer-state rows; never below 8 bits
    # > 0: pick bit widths from the expected number of restores (Check-N-Run: 2-bit for 1,
    # 3-bit <= 3, 4-bit <= 20, else 8-bit; 8-bit once restored more often), overriding
    # `encoding` and `optimizer_encoding`.
    expected_restores: int = 0
    # that table as [most expected restores, bits] pairs (bits 2..4; more restores: 8-bit)
    restore_bit_widths: list[list[int]] = field(default_factory=_check_n_run_widths)
    max_pending_bytes: int = 1 << 30  # host memory all unwritten snapshots of a rank may hold
    on_backpressure: Literal["wait", "skip"] = "skip"
    resume: str = "none"  # "none", "latest", or a checkpoint id
    on_corrupt: Literal["fail", "previous"] = "fail"  # a damaged checkpoint: stop, or try the one before
    final: bool = True  # checkpoint the last step and wait for it before exiting
    bootstrap_servers: str = ""  # Kafka sink: host:port[,host:port]
    kafka: dict[str, Any] = field(default_factory=dict)  # any librdkafka setting (SASL/TLS too)
    fs_root: str = ""  # filesystem sink: default <run_dir>/stream
    dense_dir: str = ""  # default <run_dir>/dense (a shared filesystem across nodes)
    max_frame_bytes: int = 998_976  # under Kafka's default message.max.bytes
    flush_timeout_s: float = 60.0
    connect_timeout_s: float = 15.0  # at start: how long a broker may take to answer before the job stops
    # niceness the writer thread adds to itself (Linux): encoding rows on the CPU must not
    # take cores from the training step; 0 runs it at the training thread's priority
    writer_nice: int = 10
    follow: FollowConfig = field(default_factory=FollowConfig)  # `deltarec-follow` (ckpt/follow)

    def resolved(self, run_name: str, run_dir: Path) -> "CkptConfig":
        """A copy with the run-derived defaults filled: run id, stream root, dense directory."""
        return replace(
            self,
            run_id=self.run_id or run_name,
            fs_root=self.fs_root or str(run_dir / "stream"),
            dense_dir=self.dense_dir or str(run_dir / "dense"),
            follow=replace(
                self.follow,
                export_dir=self.follow.export_dir or str(run_dir / "serving"),
                metrics=self.follow.metrics or str(run_dir / "follower.jsonl"),
            ),
        )

    def kafka_conf(self) -> dict[str, Any]:
        """librdkafka settings: `kafka` untouched, `bootstrap_servers` as `bootstrap.servers`
        (a command-line override cannot express that key's dots)."""
        conf = {str(k): v for k, v in self.kafka.items()}
        if self.bootstrap_servers:
            conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def validate(self, source: str) -> None:
        """Rules spanning this section's fields; `source` names the file for the message."""
        if not self.enabled:
            return
        src = source
        try:  # it names topics and directories: refused here, not when the first sink opens
            check_run_id(self.run_id)
        except ConfigError as exc:
            raise ConfigError(f"{src}: {exc}") from None
        self.follow.validate(src)
        for key, name in (("ckpt.encoding", self.encoding), ("ckpt.optimizer_encoding", self.optimizer_encoding)):
            if name not in codec_names():
                raise ConfigError(f"{src}: {key}={name!r} is not a codec; choose one of {', '.join(codec_names())}")
        if self.optimizer_encoding not in ("fp32", "fp16", "bf16") and get_codec(self.optimizer_encoding).row_bytes(64) < 64:
            raise ConfigError(f"{src}: ckpt.optimizer_encoding={self.optimizer_encoding!r}: optimizer state is never stored below 8 bits")
        if self.expected_restores < 0:
            raise ConfigError(f"{src}: ckpt.expected_restores must be >= 0 (0: use ckpt.encoding), got {self.expected_restores}")
        try:
            check_widths(self.restore_bit_widths)
        except ValueError as exc:
            raise ConfigError(f"{src}: ckpt.restore_bit_widths {self.restore_bit_widths}: {exc}") from None
        if self.interval_steps < 0 or self.interval_s < 0 or (self.interval_steps == 0 and self.interval_s == 0):
            raise ConfigError(f"{src}: ckpt.interval_steps and/or ckpt.interval_s must be positive")
        if self.sink == "kafka" and not self.bootstrap_servers and "bootstrap.servers" not in self.kafka:
            raise ConfigError(
                f"{src}: ckpt.sink=kafka needs ckpt.bootstrap_servers (e.g. the address `deltarec-broker start` prints)"
            )
        self._validate_kafka(src)
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"{src}: ckpt.connect_timeout_s must be positive, got {self.connect_timeout_s}")
        if self.flush_timeout_s <= 0:
            raise ConfigError(f"{src}: ckpt.flush_timeout_s must be positive (it bounds every flush), got {self.flush_timeout_s}")
        if self.resume not in ("none", "latest") and not self.resume.isdigit():
            raise ConfigError(f"{src}: ckpt.resume must be none, latest or a checkpoint id, got {self.resume!r}")
        if self.max_pending_bytes <= 0 or self.max_frame_bytes < 16384:
            raise ConfigError(f"{src}: ckpt.max_pending_bytes must be positive and ckpt.max_frame_bytes at least 16384")
        if not 0 <= self.writer_nice <= 19:
            raise ConfigError(f"{src}: ckpt.writer_nice must be in 0..19 (added to the writer thread's niceness), got {self.writer_nice}")

    def redacted_kafka(self) -> dict[str, Any]:
        """`kafka` with every secret replaced by REDACTED: what may be written to a file or a log
        (the resolved config in the run directory). The clients get `kafka` itself."""
        return {k: REDACTED if _is_secret(k) else v for k, v in self.kafka.items()}

    def _validate_kafka(self, src: str) -> None:
        """librdkafka settings are flat `name: scalar` pairs. A nested mapping comes from an
        override like `ckpt.kafka.sasl.password=x` (its dots split the key): refused here with
        the way to write it, not as a TypeError when the first client is created."""
        for key, value in self.kafka.items():
            if not isinstance(value, (str, int, float, bool)):
                raise ConfigError(
                    f"{src}: ckpt.kafka.{key} must be a string, number or boolean (a librdkafka setting), got "
                    f"{type(value).__name__}; on the command line write ckpt.kafka={{name.with.dots: value, ...}}"
                )
