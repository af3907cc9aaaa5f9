"""The job configuration: one dataclass per component, loaded from YAML.

`load_config(path, overrides)` reads a YAML file, applies `dotted.key=value` overrides,
builds the dataclasses (unknown keys and wrong types are rejected, naming the key and the
file) and checks the rules that span several fields. Each component reads only its own
section, so a newcomer finds a knob by the folder that uses it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from trainer.config_loader import ConfigError, apply_override, build, load_yaml, to_dict

ShardingType = Literal["auto", "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
SparseOptimizer = Literal["row_wise_adagrad", "adagrad", "sgd", "adam"]
DenseOptimizer = Literal["adagrad", "sgd", "adam"]


@dataclass
class RunConfig:
    """Where a run writes (`dir`, default `runs/<name>`) and its global seed."""

    name: str = "deltarec"
    dir: str = ""
    seed: int = 0

    @property
    def run_dir(self) -> Path:
        return Path(self.dir or f"runs/{self.name}")


@dataclass
class TableConfig:
    """One embedding table: its rows, width, the features that look it up, its sharding."""

    name: str
    num_embeddings: int
    embedding_dim: int
    features: list[str]
    sharding: ShardingType | None = None  # None: take sharding.default


@dataclass
class ModelConfig:
    """torchrec's DLRM (or DLRM_DCN) with tables declared here."""

    kind: Literal["dlrm", "dlrm_dcn"] = "dlrm"
    dense_in_features: int = 13
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 1])
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 16
    tables: list[TableConfig] = field(default_factory=list)


@dataclass
class ShardingConfig:
    """How tables are placed on ranks and how ranks find each other."""

    default: ShardingType = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # env:// under torchrun/slurm; tests use file:///<tmp>/rdzv for a file rendezvous.
    init_method: str = "env://"
    timeout_s: int = 300


@dataclass
class SparseOptimizerConfig:
    """The optimizer fused into the embedding kernels (applied in backward)."""

    name: SparseOptimizer = "row_wise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8


@dataclass
class DenseOptimizerConfig:
    """The optimizer of the MLPs and of data-parallel tables."""

    name: DenseOptimizer = "adagrad"
    lr: float = 0.05
    eps: float = 1e-8


@dataclass
class OptimizerConfig:
    sparse: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    dense: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)


@dataclass
class SyntheticDataConfig:
    """The learnable synthetic click stream (Zipf ids, labels from a fixed teacher)."""

    zipf_exponent: float = 1.05
    ids_per_feature: int = 1


@dataclass
class CriteoDataConfig:
    """Criteo Kaggle / Terabyte TSV files; malformed lines stop the run or are skipped."""

    train_paths: list[str] = field(default_factory=list)
    eval_paths: list[str] = field(default_factory=list)
    on_malformed: Literal["stop", "skip"] = "stop"


@dataclass
class DataConfig:
    kind: Literal["synthetic", "criteo"] = "synthetic"
    batch_size: int = 512  # per rank
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    criteo: CriteoDataConfig = field(default_factory=CriteoDataConfig)


@dataclass
class TrainConfig:
    """The loop: how long, how often to log and evaluate."""

    steps: int = 1000
    log_every: int = 50
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 20
    progress: Literal["auto", "bar", "log"] = "auto"
    threads_per_rank: int = 0  # 0: cores / local ranks
    save_params: bool = False  # at the end, each rank dumps its tensors to <run_dir>/params/rank<r>.pt


def _check_n_run_widths() -> list[list[int]]:
    from ckpt.quant import CHECK_N_RUN_WIDTHS  # the policy module owns the table

    return [list(pair) for pair in CHECK_N_RUN_WIDTHS]


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
    # niceness the writer thread adds to itself (Linux): encoding rows on the CPU must not
    # take cores from the training step; 0 runs it at the training thread's priority
    writer_nice: int = 10


@dataclass
class JobConfig:
    """The whole job; `source` is the file (and overrides) it was loaded from."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    source: str = field(default="<defaults>", init=False, compare=False)

    def table_sharding(self, table: TableConfig) -> ShardingType:
        return table.sharding or self.sharding.default

    def to_yaml(self) -> str:
        data = to_dict(self)
        data.pop("source", None)
        return yaml.safe_dump(data, sort_keys=False)

    def digest(self) -> str:
        """sha256 of the resolved config, to tie checkpoints and metrics to it."""
        return hashlib.sha256(self.to_yaml().encode()).hexdigest()


def load_config(path: str | Path, overrides: Sequence[str] = (), check_data: bool = True) -> JobConfig:
    """Load `path`, apply overrides, build and validate the job config.

    `check_data=False` skips the checks on data files (a dry run needs none)."""
    data = load_yaml(path)
    for ov in overrides:
        apply_override(data, ov)
    source = str(path) + (f" (with overrides {' '.join(overrides)})" if overrides else "")
    cfg = build(JobConfig, data, source=source)
    cfg.source = source
    validate(cfg, check_data)
    return cfg


def validate(cfg: JobConfig, check_data: bool = True) -> None:
    """Rules spanning several fields; each failure says what to change."""
    src = cfg.source
    m = cfg.model
    if not m.tables:
        raise ConfigError(f"{src}: model.tables is empty; declare at least one table")
    if not m.dense_arch_layer_sizes or not m.over_arch_layer_sizes:
        raise ConfigError(f"{src}: model.dense_arch_layer_sizes and over_arch_layer_sizes must not be empty")
    if m.over_arch_layer_sizes[-1] != 1:
        raise ConfigError(f"{src}: model.over_arch_layer_sizes must end with 1 (one logit), got {m.over_arch_layer_sizes}")
    dim = m.dense_arch_layer_sizes[-1]
    seen_tables: set[str] = set()
    seen_features: dict[str, str] = {}
    for i, t in enumerate(m.tables):
        where = f"model.tables.{i} ({t.name})"
        if t.name in seen_tables:
            raise ConfigError(f"{src}: {where}: duplicate table name {t.name!r}")
        seen_tables.add(t.name)
        if t.num_embeddings < 1 or t.embedding_dim < 1:
            raise ConfigError(f"{src}: {where}: num_embeddings and embedding_dim must be positive")
        if t.embedding_dim != dim:
            raise ConfigError(
                f"{src}: {where}: embedding_dim {t.embedding_dim} must equal the last of "
                f"model.dense_arch_layer_sizes ({dim}): DLRM interacts dense and sparse vectors of one width"
            )
        if t.embedding_dim % 4:
            raise ConfigError(f"{src}: {where}: embedding_dim must be a multiple of 4 (fbgemm kernels)")
        if not t.features:
            raise ConfigError(f"{src}: {where}: features is empty")
        for f in t.features:
            if f in seen_features:
                raise ConfigError(f"{src}: {where}: feature {f!r} is already looked up by table {seen_features[f]!r}")
            seen_features[f] = t.name
    d, tr = cfg.data, cfg.train
    if d.batch_size < 1:
        raise ConfigError(f"{src}: data.batch_size must be positive, got {d.batch_size}")
    if tr.steps < 1:
        raise ConfigError(f"{src}: train.steps must be positive, got {tr.steps}")
    if tr.log_every < 1:
        raise ConfigError(f"{src}: train.log_every must be positive, got {tr.log_every}")
    if tr.eval_every < 0 or tr.eval_batches < 0:
        raise ConfigError(f"{src}: train.eval_every and train.eval_batches must not be negative")
    if d.kind == "synthetic" and d.synthetic.zipf_exponent <= 0:
        raise ConfigError(f"{src}: data.synthetic.zipf_exponent must be > 0, got {d.synthetic.zipf_exponent}")
    _validate_ckpt(cfg)
    if d.kind == "criteo":
        if len(seen_features) != 26 or m.dense_in_features != 13:
            raise ConfigError(
                f"{src}: data.kind=criteo needs 26 categorical features and model.dense_in_features=13; "
                f"the model declares {len(seen_features)} features and {m.dense_in_features} dense inputs"
            )
        if check_data:
            _check_criteo_files(src, d.criteo)


def _validate_ckpt(cfg: JobConfig) -> None:
    c, src = cfg.ckpt, cfg.source
    if not c.enabled:
        return
    from ckpt.quant import check_widths, codec_names, get_codec  # the codec registry is the source of truth

    for key, name in (("ckpt.encoding", c.encoding), ("ckpt.optimizer_encoding", c.optimizer_encoding)):
        if name not in codec_names():
            raise ConfigError(f"{src}: {key}={name!r} is not a codec; choose one of {', '.join(codec_names())}")
    if c.optimizer_encoding not in ("fp32", "fp16", "bf16") and get_codec(c.optimizer_encoding).row_bytes(64) < 64:
        raise ConfigError(f"{src}: ckpt.optimizer_encoding={c.optimizer_encoding!r}: optimizer state is never stored below 8 bits")
    if c.expected_restores < 0:
        raise ConfigError(f"{src}: ckpt.expected_restores must be >= 0 (0: use ckpt.encoding), got {c.expected_restores}")
    try:
        check_widths(c.restore_bit_widths)
    except ValueError as exc:
        raise ConfigError(f"{src}: ckpt.restore_bit_widths {c.restore_bit_widths}: {exc}") from None
    if c.interval_steps < 0 or c.interval_s < 0 or (c.interval_steps == 0 and c.interval_s == 0):
        raise ConfigError(f"{src}: ckpt.interval_steps and/or ckpt.interval_s must be positive")
    if c.sink == "kafka" and not c.bootstrap_servers and "bootstrap.servers" not in c.kafka:
        raise ConfigError(
            f"{src}: ckpt.sink=kafka needs ckpt.bootstrap_servers (e.g. the address `deltarec-broker start` prints)"
        )
    if c.resume not in ("none", "latest") and not c.resume.isdigit():
        raise ConfigError(f"{src}: ckpt.resume must be none, latest or a checkpoint id, got {c.resume!r}")
    if c.max_pending_bytes <= 0 or c.max_frame_bytes < 16384:
        raise ConfigError(f"{src}: ckpt.max_pending_bytes must be positive and ckpt.max_frame_bytes at least 16384")
    if not 0 <= c.writer_nice <= 19:
        raise ConfigError(f"{src}: ckpt.writer_nice must be in 0..19 (added to the writer thread's niceness), got {c.writer_nice}")


def _check_criteo_files(src: str, c: CriteoDataConfig) -> None:
    if not c.train_paths:
        raise ConfigError(f"{src}: data.kind=criteo needs data.criteo.train_paths (a list of TSV files)")
    for p in c.train_paths + c.eval_paths:
        if not Path(p).is_file():
            raise ConfigError(f"{src}: data file not found: {p}")

__all__ = ["ConfigError", "JobConfig", "TableConfig", "load_config", "validate"]
