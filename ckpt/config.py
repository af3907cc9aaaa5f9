"""The `ckpt` config section: continuous checkpointing, read only by the checkpoint code, in
one section per stage (docs/configuration.md).

    ckpt:
      enabled: true
      run_id: ""            # default run.name: names the Kafka topics / segment directories
      sink: {...}           # where checkpoints go: the stream (Kafka or files) and the dense files
      schedule: {...}       # when a checkpoint is taken, and Check-N-Run's policy for its kind
      write: {...}          # the writer thread: what it may hold unwritten, its niceness
      encoding: {...}       # the codecs of weight and optimizer rows
      capture: {...}        # how rows reach host memory in the stall
      restore: {...}        # what a start resumes, and how
      recovery: {...}       # what a rank's death costs the others (full or CPR's partial)
      follow: {...}         # `deltarec-follow`: compaction, serving snapshots

Each stage is built from its own section (`Checkpointer`'s builder hands each only its own),
so a stage cannot read a setting of another. The rules that span sections are checked here,
in `CkptConfig.validate`, once. Keys of the flat layout used before (`ckpt.interval_steps`,
`ckpt.sink: kafka`, ...) still load, through the one table `FLAT_KEYS`, from files and
command-line overrides alike.

`trainer/config.py` builds it from the job's YAML and fills the run-derived defaults
(`run_id`, `sink.fs_root`, `sink.dense_dir`) with `resolved`, so nothing under ckpt/ needs the
rest of the job config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from ckpt.quant import codec_names, get_codec, resolve_widths
from ckpt.quant.bit_widths import Widths
from ckpt.stream.sink import check_run_id
from common.config_loader import apply_override, build, load_yaml, to_dict
from common.errors import ConfigError

REDACTED = "<redacted>"
# librdkafka settings that hold a secret: passwords, client secrets, private keys, OAuth configs.
_SECRET_WORDS = ("password", "secret", "ssl.key.pem", "oauthbearer.config", "keystore")


def _is_secret(name: str) -> bool:
    return any(word in name for word in _SECRET_WORDS)


@dataclass
class SinkConfig:
    """Where checkpoints go: each rank's stream of row frames and rank 0's markers (a Kafka
    cluster or a directory tree), and rank 0's dense files (ckpt/stream, ckpt/log, ckpt/dense)."""

    kind: Literal["kafka", "filesystem"] = "kafka"
    bootstrap_servers: str = ""  # Kafka: host:port[,host:port]
    kafka: dict[str, Any] = field(default_factory=dict)  # any librdkafka setting (SASL/TLS too)
    fs_root: str = ""  # filesystem: default <run_dir>/stream
    dense_dir: str = ""  # default <run_dir>/dense (a shared filesystem across nodes)
    max_frame_bytes: int = 998_976  # under Kafka's default message.max.bytes
    flush_timeout_s: float = 60.0  # bounds every flush of a writer or a follower
    connect_timeout_s: float = 15.0  # at start: how long a broker may take to answer before the job stops
    # markers-log records between catalog records (ckpt/log/catalog_record.py): a restore reads the
    # log from the newest one on, about this many records, instead of the whole log
    catalog_every: int = 32

    def kafka_conf(self) -> dict[str, Any]:
        """librdkafka settings: `kafka` untouched, `bootstrap_servers` as `bootstrap.servers`
        (a command-line override cannot express that key's dots)."""
        conf = {str(k): v for k, v in self.kafka.items()}
        if self.bootstrap_servers:
            conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def redacted_kafka(self) -> dict[str, Any]:
        """`kafka` with every secret replaced by REDACTED: what may be written to a file or a log
        (the resolved config in the run directory). The clients get `kafka` itself."""
        return {k: REDACTED if _is_secret(k) else v for k, v in self.kafka.items()}

    def validate(self, src: str) -> None:
        if self.kind == "kafka" and not self.bootstrap_servers and "bootstrap.servers" not in self.kafka:
            raise ConfigError(
                f"{src}: ckpt.sink.kind=kafka needs ckpt.sink.bootstrap_servers (e.g. the address `deltarec-broker start` prints)"
            )
        for key, value in self.kafka.items():
            # librdkafka settings are flat `name: scalar` pairs; a nested mapping comes from an
            # override like `ckpt.sink.kafka.sasl.password=x` (its dots split the key)
            if not isinstance(value, (str, int, float, bool)):
                raise ConfigError(
                    f"{src}: ckpt.sink.kafka.{key} must be a string, number or boolean (a librdkafka setting), got "
                    f"{type(value).__name__}; on the command line write ckpt.sink.kafka={{name.with.dots: value, ...}}"
                )
        if self.connect_timeout_s <= 0 or self.flush_timeout_s <= 0:
            raise ConfigError(
                f"{src}: ckpt.sink.connect_timeout_s and ckpt.sink.flush_timeout_s must be positive, "
                f"got {self.connect_timeout_s} and {self.flush_timeout_s}"
            )
        if self.catalog_every < 1:
            raise ConfigError(
                f"{src}: ckpt.sink.catalog_every must be at least 1 (records between catalog records), got {self.catalog_every}"
            )
        if self.max_frame_bytes < 16384:
            raise ConfigError(f"{src}: ckpt.sink.max_frame_bytes must be at least 16384, got {self.max_frame_bytes}")


@dataclass
class ScheduleConfig:
    """When a checkpoint is taken, and which rows it writes (Check-N-Run's policies: ckpt/save/policy.py)."""

    policy: Literal["full", "one_shot_diff", "incremental", "intermittent_diff"] = "intermittent_diff"
    interval_steps: int = 100  # 0: only by time
    interval_s: float = 0.0  # 0: only by steps; else rank 0's clock, checked every 10 steps
    final: bool = True  # checkpoint the last step and wait for it before exiting

    def validate(self, src: str) -> None:
        if self.interval_steps < 0 or self.interval_s < 0:
            raise ConfigError(f"{src}: ckpt.schedule.interval_steps and ckpt.schedule.interval_s must be >= 0")


@dataclass
class WriteConfig:
    """The writer thread of each rank (ckpt/write): what it may hold unwritten, and its priority."""

    max_pending_bytes: int = 1 << 30  # host memory all unwritten snapshots of a rank may hold
    # a checkpoint due while the pending bytes would pass that: skipped (reported), or waited for
    on_backpressure: Literal["wait", "skip"] = "skip"
    # checkpoints a rank's writer may hold unwritten or uncommitted; a checkpoint due while
    # more are is coalesced into the next one (its rows go there) instead of queueing behind
    # them, so that a checkpoint every step keeps its time to COMMIT bounded; 0: no bound;
    # None: `pending_checkpoints` chooses
    max_pending_checkpoints: int | None = None
    # checkpoints in a row coalesced at most: the next one due waits for the writers instead
    # (the training thread yields its core to them), so the steps a crash loses stay bounded
    # while the writers are slow, at the price of training waiting for them (for as long as a
    # broker outage lasts, up to `ckpt.sink.flush_timeout_s` a checkpoint); 0: no bound, training
    # never waits for them
    max_coalesced: int = 0
    # dense files kept: those of the newest N checkpoints this attempt committed (and the one it
    # restored); rank 0 deletes older ones after each COMMIT, as `deltarec-ckpt gc` would. A
    # checkpoint every step writes one a step. 0: every dense file is kept until gc
    keep_dense: int = 0
    # niceness the writer thread adds to itself (Linux): encoding rows on the CPU must not
    # take cores from the training step; 0 runs it at the training thread's priority
    writer_nice: int = 10

    def pending_checkpoints(self, interval_steps: int) -> int:
        """The bound `max_pending_checkpoints` sets; unset, 2 with a checkpoint every step (a
        queue of them is steps lost on a crash: coalescing keeps the newest close behind) and 8
        otherwise (a writer rarely holds two)."""
        if self.max_pending_checkpoints is not None:
            return self.max_pending_checkpoints
        return 2 if interval_steps == 1 else 8

    def validate(self, src: str) -> None:
        if self.max_pending_bytes <= 0:
            raise ConfigError(f"{src}: ckpt.write.max_pending_bytes must be positive, got {self.max_pending_bytes}")
        if self.max_pending_checkpoints is not None and self.max_pending_checkpoints < 0:
            raise ConfigError(f"{src}: ckpt.write.max_pending_checkpoints must be 0 (no bound) or positive")
        if self.keep_dense < 0:
            raise ConfigError(f"{src}: ckpt.write.keep_dense must be >= 0 (0: keep every dense file), got {self.keep_dense}")
        if self.max_coalesced < 0:
            raise ConfigError(f"{src}: ckpt.write.max_coalesced must be >= 0 (0: no bound), got {self.max_coalesced}")
        if not 0 <= self.writer_nice <= 19:
            raise ConfigError(
                f"{src}: ckpt.write.writer_nice must be in 0..19 (added to the writer thread's niceness), got {self.writer_nice}"
            )


@dataclass
class EncodingConfig:
    """How rows are encoded on the stream (ckpt/quant): a codec each for weights and optimizer state,
    or bit widths chosen from the number of restores expected."""

    weights: str = "fp32"  # weight rows codec (fp32, fp16, asym8, adaptive4, ...)
    optimizer: str = "fp32"  # optimizer-state rows; never below 8 bits
    # > 0: pick bit widths from the expected number of restores (`restore_bit_widths`; 8-bit
    # once restored more often than expected), overriding `weights` and `optimizer`
    expected_restores: int = 0
    # that table: a preset ("deltarec": 4-bit for 1 restore, else 8-bit; "check_n_run": 2-bit
    # for 1, 3-bit <= 3, 4-bit <= 20, else 8-bit) or [most expected restores, bits] pairs
    restore_bit_widths: str | list[list[int]] = "deltarec"

    def bit_widths(self) -> Widths:
        """`restore_bit_widths` as a table (a preset name resolved); ValueError if it is none."""
        return resolve_widths(self.restore_bit_widths)

    def validate(self, src: str) -> None:
        for key, name in (("ckpt.encoding.weights", self.weights), ("ckpt.encoding.optimizer", self.optimizer)):
            if name not in codec_names():
                raise ConfigError(f"{src}: {key}={name!r} is not a codec; choose one of {', '.join(codec_names())}")
        if self.optimizer not in ("fp32", "fp16", "bf16") and get_codec(self.optimizer).row_bytes(64) < 64:
            raise ConfigError(f"{src}: ckpt.encoding.optimizer={self.optimizer!r}: optimizer state is never stored below 8 bits")
        if self.expected_restores < 0:
            raise ConfigError(
                f"{src}: ckpt.encoding.expected_restores must be >= 0 (0: use ckpt.encoding.weights), "
                f"got {self.expected_restores}"
            )
        try:
            self.bit_widths()
        except ValueError as exc:
            raise ConfigError(f"{src}: ckpt.encoding.restore_bit_widths {self.restore_bit_widths}: {exc}") from None


@dataclass
class CaptureConfig:
    """How a checkpoint's rows reach host memory during the stall (ckpt/capture)."""

    # rows no batch has touched since the model was initialised: left out of checkpoints and
    # regenerated by restore (sharding/row_init.py), or stored like every other row
    untrained_rows: Literal["regenerate", "store"] = "regenerate"
    # CPU shards: the checkpoint's copy of rows and dense state runs on a thread of its own
    # beside the next step, whose first lookup waits for the tracker's marks and whose backward
    # pass waits for the rows before the embedding kernels may change one (ckpt/capture/overlapped_copy.py);
    # false: the training thread copies inside the stall. GPU shards gather on a side stream.
    overlap_copy: bool = True
    # CPU shards: copy-on-write snapshots (ckpt/capture/copy_on_write.py). No rows are copied at
    # the checkpoint step: the writer reads them from the live tables a window at a time, and
    # the steps after it copy aside, in their lookups, the rows they are about to update that the
    # writer has not read yet. The host then holds those rows and one window, not every row of
    # the snapshot in fp32; the training thread pays for the rows it saves aside. GPU shards: refused
    copy_on_write: bool = False
    # GPU shards: where weight rows are encoded. `device`: on the GPU, before the copy to host,
    # whenever the weight codec has a device kernel (the adaptive codecs: ckpt/quant/device.py),
    # else on the host; `host`: the snapshot copies fp32 rows and the writer encodes them
    # (docs/design/dataflow.md). CPU shards always encode on the host.
    encode_on: Literal["device", "host"] = "device"


@dataclass
class RestoreConfig:
    """What a starting job resumes, and how (ckpt/restore)."""

    resume: str = "none"  # "none", "latest", or a checkpoint id
    on_corrupt: Literal["fail", "previous"] = "fail"  # a damaged checkpoint: stop, or try the one before
    # a restarted job loads the dense file of the checkpoint it will restore while it builds its
    # model (ckpt/dense/ahead.py) and on Kafka fetches its frames, each rank those it wrote
    # (ckpt/log/frames_ahead.py)
    read_ahead: bool = True

    def validate(self, src: str) -> None:
        if self.resume not in ("none", "latest") and not self.resume.isdigit():
            raise ConfigError(f"{src}: ckpt.restore.resume must be none, latest or a checkpoint id, got {self.resume!r}")


@dataclass
class RecoveryConfig:
    """When a rank dies: every rank rolls back to the newest checkpoint (`full`), or the surviving
    ranks save what they have and keep it, only the dead ranks' shards rolling back (`partial`,
    CPR; ckpt/recovery, docs/design/partial-recovery.md)."""

    mode: Literal["full", "partial"] = "full"
    # how long a surviving rank may take to save its snapshot (torchrun SIGKILLs a rank 30 s
    # after its SIGTERM); one that cannot finish leaves nothing a restore would use
    survivor_timeout_s: float = 20.0
    # > 0 (with mode=partial): checkpoint interval from CPR's analysis, 2 * target_pls *
    # MTBF / (the largest share of the embedding parameters one rank holds) (ckpt/recovery/lost_samples.py)
    target_pls: float = 0.0
    # mean time between failures for `target_pls`; 0: estimated from this run's attempts
    # (it must then have restarted at least once)
    mtbf_s: float = 0.0
    # With mode=partial and schedule.policy=incremental, CPR's prioritized checkpoints
    # (ckpt/recovery/priority.py): a checkpoint that is not full saves at most `priority_budget` of
    # a full snapshot's bytes per rank, the most updated changed rows (`mfu`) or those a
    # sub-sample of the updates touched (`ssu`, `ssu_sample` of the ids); every
    # `priority_full_every`-th checkpoint is full
    priority: Literal["none", "mfu", "ssu"] = "none"
    priority_budget: float = 0.1
    priority_full_every: int = 10
    ssu_sample: float = 0.1

    def validate(self, src: str) -> None:
        if self.survivor_timeout_s <= 0:
            raise ConfigError(f"{src}: ckpt.recovery.survivor_timeout_s must be positive, got {self.survivor_timeout_s}")
        if not 0 <= self.target_pls < 1 or self.mtbf_s < 0:
            raise ConfigError(
                f"{src}: ckpt.recovery.target_pls must be in [0, 1) and ckpt.recovery.mtbf_s >= 0, "
                f"got {self.target_pls} and {self.mtbf_s}"
            )
        if self.target_pls > 0 and self.mode != "partial":
            raise ConfigError(
                f"{src}: ckpt.recovery.target_pls={self.target_pls} needs ckpt.recovery.mode=partial: under full "
                "recovery no sample is lost (everything since the checkpoint is trained again)"
            )
        if self.priority == "none":
            return
        if not 0 < self.priority_budget <= 1 or self.priority_full_every < 2 or not 0 < self.ssu_sample <= 1:
            raise ConfigError(
                f"{src}: ckpt.recovery.priority_budget and ckpt.recovery.ssu_sample must be in (0, 1] and "
                f"ckpt.recovery.priority_full_every >= 2, got {self.priority_budget}, {self.ssu_sample} and "
                f"{self.priority_full_every}"
            )


@dataclass
class FollowConfig:
    """When the follower compacts, how it fences, how often it publishes serving snapshots (ckpt/follow)."""

    # compact when the deltas since the newest baseline reach this fraction of its bytes ...
    compact_ratio: float = 0.5
    # ... or when this many deltas follow it (a restore replays at most about this many links)
    compact_links: int = 8
    # a follower that has not renewed its lease for this long may be replaced by another
    lease_s: float = 30.0
    poll_s: float = 1.0  # how often the markers log is read for new COMMITs
    export_every: int = 0  # serving snapshot every N applied checkpoints (0: not by count)
    export_every_s: float = 0.0  # ... or every T seconds (0: not by time)
    export_keep: int = 3  # newest serving snapshots kept
    export_dcp: bool = True  # also a torch.distributed.checkpoint directory beside each file
    export_dir: str = ""  # default <run_dir>/serving
    metrics: str = ""  # default <run_dir>/follower.jsonl

    def validate(self, src: str) -> None:
        if self.compact_ratio <= 0 or self.compact_links < 1:
            raise ConfigError(f"{src}: ckpt.follow.compact_ratio must be > 0 and ckpt.follow.compact_links >= 1")
        if self.poll_s <= 0 or self.lease_s < 3 * self.poll_s:
            raise ConfigError(
                f"{src}: ckpt.follow.poll_s must be > 0 and ckpt.follow.lease_s at least 3 x poll_s "
                f"(the lease is renewed every lease_s / 3), got poll_s={self.poll_s}, lease_s={self.lease_s}"
            )
        if self.export_every < 0 or self.export_every_s < 0 or self.export_keep < 1:
            raise ConfigError(f"{src}: ckpt.follow.export_every / export_every_s must be >= 0 and export_keep >= 1")


@dataclass
class CkptConfig:
    """Continuous checkpointing, one section per stage (module docstring)."""

    enabled: bool = False
    run_id: str = ""  # default: run.name; names the Kafka topics / segment directories
    sink: SinkConfig = field(default_factory=SinkConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    write: WriteConfig = field(default_factory=WriteConfig)
    encoding: EncodingConfig = field(default_factory=EncodingConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    restore: RestoreConfig = field(default_factory=RestoreConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    follow: FollowConfig = field(default_factory=FollowConfig)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "ckpt") -> CkptConfig:
        """A config from a mapping in the sectioned layout (old flat keys mapped: `FLAT_KEYS`),
        as strictly as a YAML file's: an unknown key or a wrong type is one line naming it."""
        return build(CkptConfig, sectioned(dict(data), source), source=source, path="ckpt")

    def resolved(self, run_name: str, run_dir: Path) -> CkptConfig:
        """A copy with the run-derived defaults filled: run id, stream root, dense directory,
        the follower's serving directory and metrics file."""
        return replace(
            self,
            run_id=self.run_id or run_name,
            sink=replace(
                self.sink,
                fs_root=self.sink.fs_root or str(run_dir / "stream"),
                dense_dir=self.sink.dense_dir or str(run_dir / "dense"),
            ),
            follow=replace(
                self.follow,
                export_dir=self.follow.export_dir or str(run_dir / "serving"),
                metrics=self.follow.metrics or str(run_dir / "follower.jsonl"),
            ),
        )

    def with_absolute_paths(self) -> CkptConfig:
        """A copy with every directory and file absolute, from the working directory ("" stays
        unset): what a run directory keeps, readable from any directory."""
        sink = replace(self.sink, fs_root=_absolute(self.sink.fs_root), dense_dir=_absolute(self.sink.dense_dir))
        follow = replace(self.follow, export_dir=_absolute(self.follow.export_dir), metrics=_absolute(self.follow.metrics))
        return replace(self, sink=sink, follow=follow)

    def validate(self, source: str) -> None:
        """Each section's rules, then those spanning sections; `source` names the file for the message."""
        if not self.enabled:
            return
        src = source
        try:  # it names topics and directories: refused here, not when the first sink opens
            check_run_id(self.run_id)
        except ConfigError as exc:
            raise ConfigError(f"{src}: {exc}") from None
        for section in (self.sink, self.schedule, self.write, self.encoding, self.restore, self.recovery, self.follow):
            section.validate(src)
        s, r = self.schedule, self.recovery
        if s.interval_steps == 0 and s.interval_s == 0 and r.target_pls == 0:
            raise ConfigError(
                f"{src}: ckpt.schedule.interval_steps and/or ckpt.schedule.interval_s "
                "(or ckpt.recovery.target_pls) must be positive"
            )
        if r.target_pls > 0 and s.interval_s > 0:
            raise ConfigError(
                f"{src}: set ckpt.recovery.target_pls or ckpt.schedule.interval_s, not both: the target sets the interval"
            )
        if r.priority != "none" and (r.mode != "partial" or s.policy != "incremental"):
            raise ConfigError(
                f"{src}: ckpt.recovery.priority={r.priority} needs ckpt.recovery.mode=partial and ckpt.schedule.policy="
                "incremental: its checkpoints leave changed rows out, which only a partial recovery "
                "accepts (it counts them as lost samples)"
            )

    def override(self, overrides: Sequence[str], source: str = "overrides") -> CkptConfig:
        """A copy with dotted `key=value` overrides applied (``ckpt.`` in front is optional; old
        flat keys mapped), as strictly as a YAML file's: an unknown key or a wrong type is one
        line naming it."""
        if not overrides:
            return self
        data = to_dict(self)
        for override in overrides:
            apply_override(data, flat_override(override.removeprefix("ckpt.")))
        return build(CkptConfig, data, source=source, path="ckpt")

    def to_yaml(self) -> str:
        """This section as a YAML file with one `ckpt:` mapping, librdkafka secrets redacted:
        what `deltarec-ckpt --config` reads for a job run by a user's own loop."""
        return yaml.safe_dump({"ckpt": self.to_data()}, sort_keys=False)

    def to_data(self) -> dict[str, Any]:
        """This section as plain YAML data, librdkafka secrets redacted."""
        data = to_dict(self)
        data["sink"]["kafka"] = self.sink.redacted_kafka()
        return data


def _absolute(path: str) -> str:
    """`path` from the working directory, as an absolute path ("" stays unset)."""
    return str(Path(path).absolute()) if path else path


# --- the flat layout used before the stage sections ----------------------------------------------

FLAT_KEYS: dict[str, str] = {
    "sink": "sink.kind",
    "bootstrap_servers": "sink.bootstrap_servers",
    "kafka": "sink.kafka",
    "fs_root": "sink.fs_root",
    "dense_dir": "sink.dense_dir",
    "max_frame_bytes": "sink.max_frame_bytes",
    "flush_timeout_s": "sink.flush_timeout_s",
    "connect_timeout_s": "sink.connect_timeout_s",
    "catalog_every": "sink.catalog_every",
    "policy": "schedule.policy",
    "interval_steps": "schedule.interval_steps",
    "interval_s": "schedule.interval_s",
    "final": "schedule.final",
    "max_pending_bytes": "write.max_pending_bytes",
    "on_backpressure": "write.on_backpressure",
    "max_pending_checkpoints": "write.max_pending_checkpoints",
    "writer_nice": "write.writer_nice",
    "encoding": "encoding.weights",
    "optimizer_encoding": "encoding.optimizer",
    "expected_restores": "encoding.expected_restores",
    "restore_bit_widths": "encoding.restore_bit_widths",
    "untrained_rows": "capture.untrained_rows",
    "overlap_copy": "capture.overlap_copy",
    "copy_on_write": "capture.copy_on_write",
    "encode_on": "capture.encode_on",
    "resume": "restore.resume",
    "on_corrupt": "restore.on_corrupt",
    "read_ahead": "restore.read_ahead",
    "recovery": "recovery.mode",
    "survivor_timeout_s": "recovery.survivor_timeout_s",
    "target_pls": "recovery.target_pls",
    "mtbf_s": "recovery.mtbf_s",
    "priority": "recovery.priority",
    "priority_budget": "recovery.priority_budget",
    "priority_full_every": "recovery.priority_full_every",
    "ssu_sample": "recovery.ssu_sample",
}
"""Each key of the flat `ckpt:` layout and the dotted key of its section that replaced it. Three
old keys are now also section names (`sink`, `encoding`, `recovery`): a scalar there is the old
key, a mapping the section."""

_SECTIONS = frozenset(f.name for f in fields(CkptConfig) if f.name not in ("enabled", "run_id"))


def _is_old(key: str, value: Any) -> bool:
    """Whether `key: value` at the top of a `ckpt:` mapping is a key of the flat layout."""
    return key in FLAT_KEYS and not (key in _SECTIONS and isinstance(value, dict))


def sectioned(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A raw `ckpt:` mapping with every flat-layout key moved into its section (`FLAT_KEYS`), in
    place; a key given both ways is refused with one line naming the one to keep."""
    old = sorted((k for k, v in data.items() if _is_old(k, v)), key=lambda k: k not in _SECTIONS)  # sink: kafka first
    for key in old:
        section, name = FLAT_KEYS[key].split(".")
        value = data.pop(key)
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{source}: ckpt.{section} must be a mapping, got {target!r}")
        if name in target:
            raise ConfigError(f"{source}: ckpt.{key} is the old name of ckpt.{FLAT_KEYS[key]}, which is also given: keep one")
        target[name] = value
    return data


def flat_override(override: str) -> str:
    """A `key=value` override of the `ckpt` section (without `ckpt.` in front) whose key is of
    the flat layout, rewritten to its section's key (`interval_steps=5` ->
    `schedule.interval_steps=5`, `kafka.acks=all` -> `sink.kafka.acks=all`); others unchanged."""
    key, sep, raw = override.partition("=")
    head, dot, rest = key.strip().partition(".")
    if not sep or head not in FLAT_KEYS:
        return override
    if head in _SECTIONS:
        if dot:  # `sink.kind=...`, `encoding.weights=...`: a key of the section
            return override
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, dict):  # `sink={kind: filesystem}`: the whole section
            return override
    return f"{FLAT_KEYS[head]}{dot}{rest}={raw}"


def job_override(override: str) -> str:
    """`flat_override` for an override of the whole job config: only `ckpt.` keys change."""
    if not override.startswith("ckpt."):
        return override
    return "ckpt." + flat_override(override.removeprefix("ckpt."))


def load_ckpt_config(path: str | Path, overrides: Sequence[str] = (), section: str = "ckpt") -> CkptConfig:
    """The `section` of a YAML file (the whole file with `section=""`) as a `CkptConfig`, with
    dotted `overrides` (`"schedule.interval_steps=50"`) applied, strictly: an unknown key or a
    value of the wrong type is one line naming it; keys of the flat layout used before load
    through `FLAT_KEYS`. Not yet resolved (`Checkpointer` fills the run id and directories from
    its `run_dir`) nor validated."""
    data = load_yaml(path)
    if section:
        data = data.get(section, {})
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: {section} must be a mapping")
    source = f"{path}{' with overrides' if overrides else ''}"
    data = sectioned(data, source)
    for override in overrides:
        apply_override(data, flat_override(override))
    return build(CkptConfig, data, source=source, path=section)
