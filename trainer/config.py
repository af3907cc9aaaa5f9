"""The job configuration: one dataclass per component, loaded from YAML.

`load_config(path, overrides)` reads a YAML file, applies `dotted.key=value` overrides,
builds the dataclasses (unknown keys and wrong types are rejected, naming the key and the
file) and checks the rules that span several fields. Each component reads only its own
section, so a newcomer finds a knob by the folder that uses it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import yaml

from ckpt.config import CkptConfig, job_override, sectioned
from common.config_loader import apply_override, build, load_yaml, to_dict
from common.errors import ConfigError
from sharding.config import EVICTION_POLICIES, OptimizerConfig, ShardingConfig, TableConfig

# A table name is a key of torchrec's module dicts (no dots), a parameter name and the table
# field of every checkpoint frame and marker: plain ASCII, like a run id, so it can never be
# read as a path or split as a dotted name wherever a tool puts it.
_TABLE_NAME = re.compile(r"[A-Za-z0-9_-]{1,200}")


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
class CriteoNpyDataConfig:
    """Criteo days in TorchRec's preprocessed format: each a prefix `<dir>/day_0` of
    `_dense.npy`, `_sparse.npy` and `_labels.npy` (trainer/data/criteo_npy.py)."""

    train_days: list[str] = field(default_factory=list)
    eval_days: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    kind: Literal["synthetic", "criteo", "criteo_npy"] = "synthetic"
    batch_size: int = 512  # per rank
    # processes per rank that read batches ahead of the loop (trainer/data/loader.py); 0 reads
    # in the training process. More than 1 needs a reader that skips batches without reading them.
    workers: int = 0
    prefetch_batches: int = 2  # per worker: batches a worker keeps ready
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    criteo: CriteoDataConfig = field(default_factory=CriteoDataConfig)
    criteo_npy: CriteoNpyDataConfig = field(default_factory=CriteoNpyDataConfig)


@dataclass
class TrainConfig:
    """The loop: how long, how often to log and evaluate."""

    steps: int = 1000
    # sparse_dist: TorchRec's TrainPipelineSparseDist (next batch's copy and input all-to-all
    # overlap this step); plain: one batch at a time (trainer/step.py)
    pipeline: Literal["sparse_dist", "plain"] = "sparse_dist"
    log_every: int = 50
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 20
    progress: Literal["auto", "bar", "log"] = "auto"
    threads_per_rank: int = 0  # 0: cores / local ranks
    # keep memory a step frees for the next instead of faulting it in again (trainer/allocator.py)
    keep_freed_memory: bool = True
    save_params: bool = False  # at the end, each rank dumps its tensors to <run_dir>/params/rank<r>.pt
    tensorboard: bool = False  # also write metrics.jsonl's scalars to <run_dir>/tensorboard


@dataclass
class ServeConfig:
    """Limits of the prediction server (trainer/serve/). A request over a limit gets a 4xx or a
    503 and one line naming the limit; the server goes on."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8470  # 0: any free port (the address file says which)
    max_body_bytes: int = 4 << 20  # a larger body: 413
    max_samples: int = 4096  # samples in one request; more: 413
    max_concurrency: int = 4  # requests computing at once
    max_queue: int = 64  # requests waiting for one of those; one more: 503
    # a request whose body has not arrived whole in this time gets 408 and its connection is
    # closed; only a request with its whole body takes one of the places above
    body_timeout_s: float = 5.0
    threads: int = 1  # torch threads per request: leave the cores to training
    poll_s: float = 0.2  # how often the markers log is read for a new COMMIT
    # readiness fails when the served checkpoint's step is older than this (0: never)
    max_staleness_s: float = 0.0
    metrics: str = ""  # the server's JSON-lines log; "" = <run_dir>/serve.jsonl

    def validate(self, src: str) -> None:
        """Refuse values no server can run with, naming the key."""
        checks = {
            "serve.port": 0 <= self.port <= 65535,
            "serve.max_body_bytes": self.max_body_bytes >= 1024,
            "serve.max_samples": self.max_samples >= 1,
            "serve.max_concurrency": self.max_concurrency >= 1,
            "serve.max_queue": self.max_queue >= 0,
            "serve.body_timeout_s": self.body_timeout_s > 0,
            "serve.threads": self.threads >= 1,
            "serve.poll_s": self.poll_s > 0,
            "serve.max_staleness_s": self.max_staleness_s >= 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"{src}: {key} = {getattr(self, key.split('.')[1])!r} is out of range")
        if not self.host:
            raise ConfigError(f"{src}: serve.host is empty")


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
    serve: ServeConfig = field(default_factory=ServeConfig)
    source: str = field(default="<defaults>", init=False, compare=False)

    def to_yaml(self) -> str:
        """The resolved config as YAML, librdkafka secrets redacted (it is written to the run
        directory, which is shared more widely than the config file the user keeps)."""
        data = to_dict(self)
        data.pop("source", None)
        data["ckpt"] = self.ckpt.to_data()
        return yaml.safe_dump(data, sort_keys=False)

    def run_file_yaml(self) -> str:
        """`to_yaml` with every path in it absolute: what the run directory keeps as
        config.yaml, which `deltarec-ckpt`, `-follow`, `-serve` and `-train` then read from any
        directory (the paths are as the job resolved them from its working directory)."""

        def absolute(path: str) -> str:
            return str(Path(path).absolute()) if path else path

        def all_absolute(paths: list[str]) -> list[str]:
            return [absolute(p) for p in paths]

        d = self.data
        data = replace(
            d,
            criteo=replace(
                d.criteo, train_paths=all_absolute(d.criteo.train_paths), eval_paths=all_absolute(d.criteo.eval_paths)
            ),
            criteo_npy=replace(
                d.criteo_npy, train_days=all_absolute(d.criteo_npy.train_days), eval_days=all_absolute(d.criteo_npy.eval_days)
            ),
        )
        ckpt = self.ckpt.with_absolute_paths()
        run = replace(self.run, dir=str(self.run.run_dir.absolute()))
        serve = replace(self.serve, metrics=absolute(self.serve.metrics))
        return replace(self, run=run, data=data, ckpt=ckpt, serve=serve).to_yaml()

    def digest(self) -> str:
        """sha256 of the resolved config, to tie checkpoints and metrics to it."""
        return hashlib.sha256(self.to_yaml().encode()).hexdigest()

    def model_digest(self) -> str:
        """sha256 of the model section: what a checkpoint's rows and dense state depend on."""
        return hashlib.sha256(repr(self.model).encode()).hexdigest()


def load_config(path: str | Path, overrides: Sequence[str] = (), check_data: bool = True) -> JobConfig:
    """Load `path`, apply overrides, build and validate the job config.

    `check_data=False` skips the checks on data files (a dry run needs none)."""
    data = load_yaml(path)
    source = str(path) + (f" (with overrides {' '.join(overrides)})" if overrides else "")
    if isinstance(data.get("ckpt"), dict):  # the flat layout's keys, in their sections
        data["ckpt"] = sectioned(data["ckpt"], source)
    for ov in overrides:
        apply_override(data, job_override(ov))
    cfg = build(JobConfig, data, source=source)
    cfg.source = source
    cfg.ckpt = cfg.ckpt.resolved(run_name=cfg.run.name, run_dir=cfg.run.run_dir)
    validate(cfg, check_data)
    return cfg


def validate(cfg: JobConfig, check_data: bool = True) -> None:
    """Rules spanning several fields; each failure says what to change."""
    src = cfg.source
    features = _validate_model(src, cfg.model)
    _validate_hashed_tables(src, cfg.model.tables, cfg.sharding)
    _validate_loop(src, cfg)
    _validate_optimizer(src, cfg.optimizer)
    _validate_synthetic(src, cfg.data)
    cfg.ckpt.validate(src)
    cfg.serve.validate(src)
    _validate_criteo(src, cfg.data, cfg.model, features, check_data)


def _validate_model(src: str, m: ModelConfig) -> dict[str, str]:
    """The `model` section: its layer sizes, then its tables; returns feature -> the table
    that looks it up."""
    if not m.tables:
        raise ConfigError(f"{src}: model.tables is empty; declare at least one table")
    _validate_layers(src, m)
    return _validate_tables(src, m.tables, dim=m.dense_arch_layer_sizes[-1])


def _validate_layers(src: str, m: ModelConfig) -> None:
    """The MLP sizes: none empty or below 1, and one logit out."""
    for key, layers in (("dense_arch_layer_sizes", m.dense_arch_layer_sizes), ("over_arch_layer_sizes", m.over_arch_layer_sizes)):
        if not layers:
            raise ConfigError(f"{src}: model.{key} must not be empty")
    sizes: dict[str, list[int]] = {
        "model.dense_in_features": [m.dense_in_features],
        "model.dense_arch_layer_sizes": m.dense_arch_layer_sizes,
        "model.over_arch_layer_sizes": m.over_arch_layer_sizes,
    }
    if m.kind == "dlrm_dcn":
        sizes.update({"model.dcn_num_layers": [m.dcn_num_layers], "model.dcn_low_rank_dim": [m.dcn_low_rank_dim]})
    _check_minimum(src, sizes, 1)
    if m.over_arch_layer_sizes[-1] != 1:
        raise ConfigError(f"{src}: model.over_arch_layer_sizes must end with 1 (one logit), got {m.over_arch_layer_sizes}")


def _validate_tables(src: str, tables: list[TableConfig], dim: int) -> dict[str, str]:
    """`model.tables`: names unique and safe, sizes DLRM and fbgemm accept (`dim`: the dense
    arch's output width), each feature looked up by one table; returns feature -> its table."""
    seen_tables: set[str] = set()
    seen_features: dict[str, str] = {}
    for i, t in enumerate(tables):
        where = f"model.tables.{i} ({t.name})"
        if not _TABLE_NAME.fullmatch(t.name):
            raise ConfigError(
                f"{src}: model.tables.{i}.name {t.name!r} must match [A-Za-z0-9_-]{{1,200}}: it names the table "
                f"in the model's parameters and in every checkpoint frame and marker"
            )
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
    return seen_features


def _validate_hashed_tables(src: str, tables: list[TableConfig], sharding: ShardingConfig) -> None:
    """The tables with `managed_collision`: placed row_wise (torchrec shards managed-collision
    modules by rows only), a known eviction policy, at least one raw id per row, evictions at
    least every step. The optimizer's fit depends on the device: sharding/plan.py checks it."""
    for i, t in enumerate(tables):
        mc = t.managed_collision
        if mc is None:
            continue
        where = f"model.tables.{i} ({t.name})"
        if sharding.type_of(t) != "row_wise":
            raise ConfigError(
                f"{src}: {where}: a hashed table (managed_collision) is sharded row_wise only, not "
                f"{sharding.type_of(t)}; set its sharding: row_wise"
            )
        if mc.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(
                f"{src}: {where}: managed_collision.eviction_policy {mc.eviction_policy!r} is unknown; "
                f"use one of {', '.join(EVICTION_POLICIES)}"
            )
        if mc.input_hash_size < t.num_embeddings:
            raise ConfigError(
                f"{src}: {where}: managed_collision.input_hash_size {mc.input_hash_size} is below "
                f"num_embeddings {t.num_embeddings}; a hashed table has at most as many rows as raw ids"
            )
        if mc.eviction_interval < 1:
            raise ConfigError(
                f"{src}: {where}: managed_collision.eviction_interval must be at least 1, got {mc.eviction_interval}"
            )


def _validate_loop(src: str, cfg: JobConfig) -> None:
    """The training loop's counts: `data.batch_size`, the `train` section, `sharding.timeout_s`."""
    d, tr = cfg.data, cfg.train
    if d.batch_size < 1:
        raise ConfigError(f"{src}: data.batch_size must be positive, got {d.batch_size}")
    if tr.steps < 1:
        raise ConfigError(f"{src}: train.steps must be positive, got {tr.steps}")
    if tr.log_every < 1:
        raise ConfigError(f"{src}: train.log_every must be positive, got {tr.log_every}")
    if tr.eval_every < 0 or tr.eval_batches < 0:
        raise ConfigError(f"{src}: train.eval_every and train.eval_batches must not be negative")
    _check_minimum(src, {"sharding.timeout_s": [cfg.sharding.timeout_s]}, 1)
    _check_minimum(src, {"train.threads_per_rank": [tr.threads_per_rank], "data.workers": [d.workers]}, 0)
    _check_minimum(src, {"data.prefetch_batches": [d.prefetch_batches]}, 1)
    if d.workers > 1 and d.kind == "criteo":
        raise ConfigError(
            f"{src}: data.workers={d.workers}: the {d.kind} reader reads its lines in order, so only one "
            f"worker per rank can read ahead; set data.workers to 0 or 1"
        )


def _validate_optimizer(src: str, o: OptimizerConfig) -> None:
    """The `optimizer` section: learning rates and epsilons torch accepts."""
    _check_minimum(
        src,
        {
            "optimizer.sparse.lr": [o.sparse.lr],
            "optimizer.sparse.eps": [o.sparse.eps],
            "optimizer.dense.lr": [o.dense.lr],
            "optimizer.dense.eps": [o.dense.eps],
        },
        0,
    )


def _validate_synthetic(src: str, d: DataConfig) -> None:
    """`data.synthetic`, when it is the data: a Zipf exponent that defines a distribution."""
    if d.kind == "synthetic" and d.synthetic.zipf_exponent <= 0:
        raise ConfigError(f"{src}: data.synthetic.zipf_exponent must be > 0, got {d.synthetic.zipf_exponent}")


def _validate_criteo(src: str, d: DataConfig, m: ModelConfig, features: dict[str, str], check_data: bool) -> None:
    """`data.criteo`, when it is the data: the model's inputs match Criteo's columns (`features`:
    the model's categorical features) and, with `check_data`, its files exist."""
    if d.kind == "synthetic":
        return
    if len(features) != 26 or m.dense_in_features != 13:
        raise ConfigError(
            f"{src}: data.kind={d.kind} needs 26 categorical features and model.dense_in_features=13; "
            f"the model declares {len(features)} features and {m.dense_in_features} dense inputs"
        )
    if check_data and d.kind == "criteo":
        _check_criteo_files(src, d.criteo)
    if check_data and d.kind == "criteo_npy":
        _check_criteo_days(src, d.criteo_npy)


def _check_minimum(src: str, values: Mapping[str, Sequence[float]], minimum: int) -> None:
    """Refuse the first key (dotted path -> its value, or a list's items) below `minimum`: sizes,
    counts, timeouts and learning rates the YAML types accept but torch would refuse with a
    traceback when the job starts."""
    for key, items in values.items():
        for value in items:
            if value < minimum:
                raise ConfigError(f"{src}: {key} must be at least {minimum}, got {items if len(items) > 1 else value}")


def _check_criteo_files(src: str, c: CriteoDataConfig) -> None:
    if not c.train_paths:
        raise ConfigError(f"{src}: data.kind=criteo needs data.criteo.train_paths (a list of TSV files)")
    for p in c.train_paths + c.eval_paths:
        if not Path(p).is_file():
            raise ConfigError(f"{src}: data file not found: {p}")


def _check_criteo_days(src: str, c: CriteoNpyDataConfig) -> None:
    if not c.train_days:
        raise ConfigError(f"{src}: data.kind=criteo_npy needs data.criteo_npy.train_days (prefixes such as /data/day_0)")
    for prefix in c.train_days + c.eval_days:
        for part in ("dense", "sparse", "labels"):
            if not Path(f"{prefix}_{part}.npy").is_file():
                raise ConfigError(f"{src}: data file not found: {prefix}_{part}.npy (day {prefix})")


__all__ = ["CkptConfig", "ConfigError", "JobConfig", "ShardingConfig", "TableConfig", "load_config", "validate"]
