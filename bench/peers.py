"""deltarec against its peers, side by side, in one invocation (suites `quick` and `full`).

    python -m bench.run --suite quick|full [--out results.json] [--plots docs/img] [--keep DIR]

On one model, one data stream and one checkpoint interval (the suite's), in this order:

1. every deltarec policy (full, one_shot_diff, incremental, intermittent_diff) x encoding
   (fp32, adaptive4): a real training job of 2 gloo ranks spawned like the tests do
   (`launch.ranks.spawn_ranks`), checkpointing to one embedded Tansu broker, each rank run
   through `bench.ckpt_rank` (the trainer's job, plus per checkpoint from the checkpointer's
   public stats: the stall's parts, a bare copy of the very rows the snapshot copied, and
   the step at which the outcome was known). From `<run_dir>/metrics.jsonl`: rows, bytes,
   stall, committed; from the COMMIT markers: the bytes the newest restorable checkpoint
   needs (its chain plus its dense file).
   Then deltarec + follower (`incremental+follower` x fp32/adaptive4): the
   `incremental` policy (one full checkpoint, then only deltas) over `follower_intervals`
   intervals, with `ckpt.follow.Follower` tailing the stream on a thread of this process
   (the job's own resolved `ckpt` section, default `ckpt.follow.*` settings) and folding
   the deltas into compacted baselines; the trainer's markers then start from the newest
   one. From `<run_dir>/follower.jsonl`: lag (checkpoints and seconds behind the newest
   COMMIT) and the compacted bytes; from the markers log folded by `ckpt.log.catalog` in log
   order: the bytes of each checkpoint's cheapest restorable chain as of the end of its
   interval.
2. `bench.peers_rank` (2 ranks, the same job in-process): training with no checkpoint,
   `dcp.save`, `dcp.async_save` (cloning stager), `torch.save` per rank, every interval,
   then restore to training-ready: `dcp.load`, `torch.load`, and `Checkpointer.restore`
   of the newest checkpoint of each deltarec job of step 1 (with a follower: its cheapest
   chain, from the newest compacted baseline).

Writes one flat list of records (`--out`), each ``{peer, policy, encoding, metric, value,
unit, interval, ckpt}`` (see docs/peers.md), prints a table, and with `--plots` draws
Check-N-Run's Figure 15 (bytes written per interval) and 16 (storage required per
interval). A benchmark, not a test: it asserts nothing about the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
import uuid
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    RESTORE_PARTS,
    Measurement,
    config_path,
    document_head,
    figure,
    harmonic_of,
    loadavg,
    log,
    machine_info,
    mean_of,
    median_of,
    ratio,
    unit_of,
)
from bench.cpu import checkpoint_cpu, process_cpu_s
from ckpt.events import Event
from common.process import run_main
from launch.broker import EmbeddedBroker

POLICIES = ("full", "one_shot_diff", "incremental", "intermittent_diff")
ENCODINGS = ("fp32", "adaptive4")
DEFAULT_POLICY, DEFAULT_QUANT = "intermittent_diff", "adaptive4"
PEERS = ("dcp.save", "dcp.async_save", "torch.save")
# deltarec's `incremental` policy with a follower compacting its chain: a policy label of the records
FOLLOWER = "incremental+follower"

# Criteo Kaggle's 26 categorical cardinalities (configs/criteo_kaggle_8gpu.yaml)
CRITEO_KAGGLE = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]

SIZES: dict[str, dict[str, Any]] = {
    # the quickstart model (8 tables, 457k rows, 2 ranks)
    # follower_intervals: checkpoints of the deltarec + follower jobs, enough for the follower's
    # default thresholds (deltas >= half the baseline's bytes, or 8 deltas) to compact at least once
    "quick": {
        "config": "configs/quickstart.yaml",
        "steps": 48,
        "interval": 12,
        "repeats": 3,
        "overrides": [],
        "follower_intervals": 12,
    },
    # 26 tables with Criteo Kaggle's cardinalities capped at 1M rows, dim 64: 5.6M rows,
    # 1.43 GB of fp32 embeddings (+ row-wise momentum); not run within CI
    # an interval of 170 steps (its seconds: docs/peers.md, "What runs")
    "full": {
        "config": None,
        "steps": 510,
        "interval": 170,
        "repeats": 2,
        "cap": 1_000_000,
        "dim": 64,
        "overrides": ["data.batch_size=2048"],
        "follower_intervals": 8,
    },
}


def full_config(path: Path, cap: int, dim: int) -> Path:
    """The full suite's model: quickstart's job with Criteo Kaggle's 26 tables (capped)."""
    import yaml

    data = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    data["run"]["name"] = "bench_full"
    data["model"]["tables"] = [
        {"name": f"t_cat_{i}", "num_embeddings": min(n, cap), "embedding_dim": dim, "features": [f"cat_{i}"]}
        for i, n in enumerate(CRITEO_KAGGLE)
    ]
    data["model"]["dense_arch_layer_sizes"] = [128, dim]
    data["model"]["over_arch_layer_sizes"] = [256, 64, 1]
    data["sharding"] = {"default": "table_wise"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# -- measurements --------------------------------------------------------------------------------
def capacity(config: str, overrides: list[str], bootstrap: str, run_id: str, ranks: int) -> dict[int, dict[str, int]]:
    """Per committed checkpoint id: bytes of its chain (rows of base + deltas) and its dense file."""
    from ckpt.log.backend import open_backend
    from ckpt.log.catalog import commits
    from trainer.config import load_config

    cfg = load_config(
        config,
        [*overrides, "ckpt.enabled=true", f"ckpt.sink.bootstrap_servers={bootstrap}", f"ckpt.run_id={run_id}"],
        check_data=False,
    )
    backend = open_backend(cfg.ckpt.run_id, cfg.ckpt.sink, ranks)
    try:
        found = commits(backend.markers.read_markers(), run_id)
    finally:
        backend.close()
    return {
        m.checkpoint_id: {"chain_bytes": m.chain_bytes, "dense_bytes": int(m.dense.get("bytes", 0)), "links": len(m.chain)}
        for _, m in found
    }


def steps_lost(ckpts: list[tuple[int, int | None]], interval: int, steps: int) -> float | None:
    """Expected steps to re-train after a crash at a uniformly random step of [interval, steps):
    k steps done, restorable = newest checkpoint step whose durable step <= k (0: none)."""
    ks = range(interval, steps)
    if not ks:
        return None
    lost = []
    for k in ks:
        restorable = max((s for s, d in ckpts if d is not None and d <= k), default=0)
        lost.append(k - restorable)
    return sum(lost) / len(lost)


def broker_cpu_s(broker: EmbeddedBroker) -> float:
    """CPU seconds the broker process has spent so far."""
    assert broker.pid is not None, "broker not started"
    cpu = process_cpu_s(broker.pid)
    assert cpu is not None, f"broker pid {broker.pid} is gone"
    return cpu


def deltarec_job(
    policy: str, encoding: str, s: dict[str, Any], work: Path, broker: EmbeddedBroker, prefix: str, timeout_s: float
) -> dict[str, Any]:
    """One deltarec job on its own fresh broker (`broker`, started for it): its checkpoints,
    throughput, the capacity of each checkpoint and the broker's CPU while it trained."""
    from bench.ckpt_bench import train_run
    from launch.ranks import read_metrics

    label = f"{policy}-{encoding}"
    ns = Namespace(
        policy=policy,
        interval=s["interval"],
        steps=s["steps"],
        overrides=["ckpt.schedule.final=false", *s["overrides"]],
        config=s["config"],
        ranks=s.get("ranks", 2),
        timeout_s=timeout_s,
    )
    bootstrap, cpu0 = broker.bootstrap, broker_cpu_s(broker)
    run = train_run(label, [f"ckpt.encoding.weights={encoding}"], ns, work, bootstrap, prefix)
    run["broker_cpu_s"], run["bootstrap"] = broker_cpu_s(broker) - cpu0, bootstrap
    metrics = read_metrics(work / label / "run")
    rates = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
    run["skipped"] = sum(1 for m in metrics if m.get("ckpt_skipped"))  # writers still busy: back-pressure
    run["samples_per_s"] = harmonic_of(rates[1:] or rates)  # every window but the first (start-up)
    run["capacity"] = capacity(
        s["config"], [*ns.overrides, f"ckpt.encoding.weights={encoding}"], bootstrap, run["run_id"], ns.ranks
    )
    run["run_dir"] = str(work / label / "run")
    return run


class _JsonLines:
    """The follower's metrics sink: `<run_dir>/follower.jsonl`, as `deltarec-follow` writes it,
    opened at the first record (the run directory is the trainer's to create)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        record = event.to_record()
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", buffering=1)
            self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class FollowerThread:
    """`ckpt.follow.Follower` of one run on a thread of this process, started before the
    trainer's ranks. Once `finish()` is called (the ranks have exited) it stops as soon as it
    has applied the newest COMMIT, or after `grace_s`."""

    def __init__(self, cfg: Any, grace_s: float) -> None:
        self.cfg = cfg
        self.grace_s = grace_s
        self.sink = _JsonLines(Path(cfg.follow.metrics))
        self.training_done = threading.Event()
        self.deadline = float("inf")
        self.error: str | None = None
        self.stats: dict[str, Any] = {}
        self.caught_up = False
        self.catch_up_s: float | None = None  # ranks exited -> newest COMMIT applied
        self._done_at = 0.0
        self._thread = threading.Thread(target=self._run, name="bench-follower", daemon=True)

    def start(self) -> FollowerThread:
        self._thread.start()
        return self

    def _until(self, f: Any) -> bool:
        if not self.training_done.is_set():
            return False
        newest = max(f.catalog.commits, default=None)
        if newest is not None and f.applied is not None and f.applied.checkpoint_id >= newest:
            self.caught_up = True
            self.catch_up_s = time.monotonic() - self._done_at
            return True
        return time.monotonic() > self.deadline

    def _run(self) -> None:
        from dataclasses import asdict

        from ckpt.follow.follower import Follower

        try:
            c = self.cfg
            f = Follower(c.run_id, c.sink, c.follow, self.sink)
            try:
                f.run(until=self._until)
            finally:
                self.stats = asdict(f.stats)
        except Exception as exc:  # noqa: BLE001 - reported with the figures, the suite goes on
            self.error = f"{type(exc).__name__}: {exc}"
            log(f"follower of {self.cfg.run_id} failed: {self.error}")
        finally:
            self.sink.close()

    def finish(self) -> None:
        """The ranks have exited: let the follower catch up, then stop it."""
        self._done_at = time.monotonic()
        self.deadline = self._done_at + self.grace_s
        self.training_done.set()
        self._thread.join(self.grace_s + 120)
        if self._thread.is_alive():
            self.error = self.error or f"still running {self.grace_s + 120:.0f} s after training ended"


def chain_capacity(config: str, overrides: list[str], bootstrap: str, run_id: str, ranks: int) -> dict[int, dict[str, Any]]:
    """Per committed checkpoint id: bytes of its cheapest restorable chain (`ckpt.log.catalog`,
    compacted baselines included) and of its dense file, as of the end of its interval: the
    markers log folded in order up to the next COMMIT (the newest: to the end of the log)."""
    from ckpt.log.backend import open_backend
    from ckpt.log.catalog import Catalog
    from ckpt.stream.sink import is_compacted
    from trainer.config import load_config

    cfg = load_config(
        config,
        [*overrides, "ckpt.enabled=true", f"ckpt.sink.bootstrap_servers={bootstrap}", f"ckpt.run_id={run_id}"],
        check_data=False,
    )
    backend = open_backend(cfg.ckpt.run_id, cfg.ckpt.sink, ranks)
    try:
        records = backend.markers.read_markers()
    finally:
        backend.close()
    catalog = Catalog(run_id)
    out: dict[int, dict[str, Any]] = {}

    def measure(cid: int) -> None:
        own = catalog.commits[cid]
        m = catalog.cheapest(own)
        if m is not None:
            out[cid] = {
                "chain_bytes": m.chain_bytes,
                "dense_bytes": int(m.dense.get("bytes", 0)),
                "links": len(m.chain),
                "chain": [link.checkpoint_id for link in m.chain],
                "from_compacted": is_compacted(m.chain[0].generation),
                # the trainer's own COMMIT already starts from a compacted baseline (it rebased)
                "marker_from_compacted": is_compacted(own.chain[0].generation),
            }

    newest: int | None = None
    for record in records:
        before = len(catalog.commits)
        catalog.feed([record])
        if len(catalog.commits) != before:
            if newest is not None:
                measure(newest)
            newest = max(catalog.commits)
    if newest is not None:
        measure(newest)
    return out


FOLLOWER_MEMORY = ("rss_ready_bytes", "rss_peak_bytes", "hwm_bytes", "status_ready", "status_end")  # a FollowerProcess's


def follower_job(
    encoding: str,
    s: dict[str, Any],
    work: Path,
    broker: EmbeddedBroker,
    prefix: str,
    timeout_s: float,
    intervals: int,
    grace_s: float,
    process: bool = False,
) -> dict[str, Any]:
    """deltarec + follower: the `incremental` policy over `intervals` checkpoints with a
    follower compacting its chain (started before the ranks, stopped once it has applied the
    newest COMMIT); then its lag and compactions, and the cheapest chain per checkpoint.
    `broker`: a fresh one for this job (its CPU counts the follower's reads too). `process`:
    the follower is `deltarec-follow` in its own process (`bench.follower_proc`), its memory
    measured, rather than a thread of this one."""
    from bench.ckpt_bench import train_run
    from bench.follower_proc import FollowerProcess
    from launch.ranks import read_jsonl, read_metrics
    from trainer.config import load_config

    bootstrap, cpu0 = broker.bootstrap, broker_cpu_s(broker)

    label = f"incremental-follower-{encoding}"  # a run id: Kafka topic names take no "+"
    run_id, run_dir = f"{prefix}-{label}", work / label / "run"
    steps = s["interval"] * intervals
    ns = Namespace(
        policy="incremental",
        interval=s["interval"],
        steps=steps,
        config=s["config"],
        ranks=s.get("ranks", 2),
        overrides=["ckpt.schedule.final=false", *s["overrides"]],
        timeout_s=timeout_s,
    )
    job = [
        f"run.dir={run_dir}",
        "ckpt.enabled=true",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.policy=incremental",
        f"ckpt.schedule.interval_steps={s['interval']}",
        f"ckpt.encoding.weights={encoding}",
        *ns.overrides,
    ]
    cfg = load_config(s["config"], job, check_data=False).ckpt  # what `deltarec-follow --config C job...` resolves
    log(
        f"follower for run {run_id} (compact at deltas >= {cfg.follow.compact_ratio} x the baseline or "
        f"{cfg.follow.compact_links} links; poll every {cfg.follow.poll_s} s; "
        f"{'its own process' if process else 'a thread of this process'})"
    )
    follower: FollowerThread | FollowerProcess
    if process:
        proc = FollowerProcess(s["config"], job, Path(cfg.follow.metrics), work / f"{label}-follower.log", grace_s)
        follower = proc.start()
        run = None
        try:
            run = train_run(label, [f"ckpt.encoding.weights={encoding}"], ns, work, bootstrap, prefix)
        finally:
            proc.finish(max((c["ckpt_id"] for c in run["checkpoints"] if c["committed"]), default=None) if run else None)
    else:
        follower = FollowerThread(cfg, grace_s).start()
        try:
            run = train_run(label, [f"ckpt.encoding.weights={encoding}"], ns, work, bootstrap, prefix)
        finally:
            follower.finish()
    run["broker_cpu_s"], run["bootstrap"] = broker_cpu_s(broker) - cpu0, bootstrap
    assert run["run_id"] == run_id, (run["run_id"], run_id)
    metrics = read_metrics(run_dir)
    rates = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
    run["skipped"] = sum(1 for m in metrics if m.get("ckpt_skipped"))
    run["samples_per_s"] = harmonic_of(rates[1:] or rates)
    run["capacity"] = chain_capacity(
        s["config"], [*ns.overrides, f"ckpt.encoding.weights={encoding}"], bootstrap, run_id, ns.ranks
    )
    run["run_dir"] = str(run_dir)
    run["steps"] = steps
    fol = read_jsonl(Path(cfg.follow.metrics)) if Path(cfg.follow.metrics).is_file() else []
    run["follower"] = {
        "applied": [r for r in fol if "follow_ckpt" in r],
        "compactions": [r for r in fol if "compacted_ckpt" in r],
        "memory": {k: getattr(follower, k) for k in FOLLOWER_MEMORY} if process else None,
        "stats": follower.stats,
        "error": follower.error,
        "caught_up": follower.caught_up,
        "catch_up_s": follower.catch_up_s,
        "settings": {
            "compact_ratio": cfg.follow.compact_ratio,
            "compact_links": cfg.follow.compact_links,
            "poll_s": cfg.follow.poll_s,
            "lease_s": cfg.follow.lease_s,
        },
    }
    c = run["follower"]
    log(
        f"follower of {run_id}: {len(c['applied'])} passes applied, {len(c['compactions'])} compactions, "
        f"caught up {c['caught_up']} ({c['catch_up_s'] or 0:.1f} s after training)" + (f"; {c['error']}" if c["error"] else "")
    )
    return run


def baseline_job(s: dict[str, Any], work: Path, timeout_s: float) -> dict[str, Any]:
    """The same job spawned the same way without checkpointing: deltarec's throughput baseline."""
    from bench.ckpt_bench import baseline_run
    from launch.ranks import read_metrics

    ns = Namespace(
        interval=s["interval"],
        steps=s["steps"],
        overrides=s["overrides"],
        config=s["config"],
        ranks=s.get("ranks", 2),
        timeout_s=timeout_s,
    )
    run = baseline_run(ns, work)
    rates = [m["samples_per_s"] for m in read_metrics(work / "no-ckpt" / "run") if "samples_per_s" in m]
    run["samples_per_s"] = harmonic_of(rates[1:] or rates)
    return run


def peers_job(
    s: dict[str, Any],
    work: Path,
    jobs: dict[tuple[str, str], dict],
    timeout_s: float,
    names: tuple[str, ...] = PEERS,
    world_size: int | None = None,
    build_s: float | None = None,
) -> list[dict]:
    """The peers' phases (`names`, in order), then every restore (each deltarec job's from its
    own broker), on `world_size` ranks (default: the job's own, `s["ranks"]`). On another world
    size than the jobs trained on, only deltarec's restores run (`bench.peers_rank
    --restore-only`): restoring into another world size, in `<work>/restore-<n>ranks`.
    `build_s`: how long each deltarec restore stands in for a restarted job's model build
    (`bench.peers_rank --build-s`; default: the job's own build)."""
    from launch.ranks import spawn_ranks

    ranks = s.get("ranks", 2)
    world = world_size or ranks
    restore_only = world != ranks
    tmp = work / (f"restore-{world}ranks" if restore_only else "peers")
    tmp.mkdir(parents=True)
    extra = ["--out-dir", str(tmp), "--steps", str(s["steps"]), "--interval", str(s["interval"]), "--repeats", str(s["repeats"])]
    extra += ["--restore-only"] if restore_only else ["--peers", *names]
    extra += [] if build_s is None else ["--build-s", str(build_s)]
    for (policy, enc), run in jobs.items():
        label = f"{policy}-{enc}"
        extra += [
            "--restore",
            f"{label}={run['run_id']}={run['run_dir']}",
            "--restore-override",
            f"{label}=ckpt.encoding.weights={enc}",
            "--restore-override",
            f"{label}=ckpt.sink.bootstrap_servers={run['bootstrap']}",
        ]
        if policy == FOLLOWER:  # the same restore with no frames fetched ahead (`ckpt.restore.read_ahead`)
            extra += ["--restore", f"{label}-cold={run['run_id']}={run['run_dir']}"]
            for kv in (
                f"ckpt.encoding.weights={enc}",
                f"ckpt.sink.bootstrap_servers={run['bootstrap']}",
                "ckpt.restore.read_ahead=false",
            ):
                extra += ["--restore-override", f"{label}-cold={kv}"]
    if restore_only:
        log(f"deltarec's restores of {ranks} ranks' checkpoints into {world} ranks")
    else:
        log(f"peers on {world} ranks: no checkpoint / {' / '.join(names)}, then restores")
    spawn_ranks(
        s["config"],
        ["train.eval_every=0", "train.eval_batches=0", *s["overrides"]],
        tmp,
        world_size=world,
        timeout_s=timeout_s,
        module="bench.peers_rank",
        extra_args=extra,
    )
    return [json.loads((tmp / f"peers_rank{r}.json").read_text()) for r in range(world)]


# -- records ----------------------------------------------------------------------------------------
@dataclass
class PeerRecords:
    """The suite's measurements, labelled by peer, policy, encoding, the interval and the
    checkpoint (None: an aggregate over the run)."""

    interval: int
    items: list[Measurement] = field(default_factory=list)
    common: dict[str, Any] = field(default_factory=dict)  # labels every record carries (gpu-peers: `size`)

    def add(
        self,
        peer: str,
        policy: str | None,
        encoding: str | None,
        metric: str,
        value: Any,
        unit: str,
        ckpt: int | None = None,
        **extra: Any,
    ) -> None:
        """Record a figure; a missing one (None) is left out."""
        if value is None:
            return
        labels = {
            "peer": peer,
            "policy": policy,
            "encoding": encoding,
            "interval": self.interval,
            "ckpt": ckpt,
            **self.common,
            **extra,
        }
        self.items.append(Measurement(metric, round(value, 6) if isinstance(value, float) else value, unit, labels))

    def series(self, metric: str, **labels: Any) -> list[tuple[int, Any]]:
        """(checkpoint, value) of the per-checkpoint figures of `metric` whose labels match, in
        checkpoint order."""
        return sorted(
            (m.labels["ckpt"], m.value)
            for m in self.items
            if m.metric == metric and m.labels["ckpt"] is not None and all(m.labels.get(k) == v for k, v in labels.items())
        )


def build_records(
    s: dict[str, Any],
    jobs: dict[tuple[str, str], dict],
    peers: list[dict],
    base: dict[str, Any],
    common: dict[str, Any] | None = None,
) -> tuple[PeerRecords, dict]:
    """Every figure of a run as records, and their summary (`summary["peers"]`, `["deltarec"]`
    by `policy/encoding`). `s`: the run's `interval` and `steps`; `jobs`: each deltarec job's
    run by (policy, encoding); `peers`: every rank's `bench.peers_rank` output (its `phases`,
    the peers present among `PEERS`, and `restore`); `base`: the job without checkpoints;
    `common`: labels every record carries."""
    rec = PeerRecords(s["interval"], common=dict(common or {}))
    steps, interval = s["steps"], s["interval"]
    p0 = peers[0]
    # peers: no-checkpoint phases of the same process (before and after the peers' phases)
    none_rate = harmonic_of([ph["samples_per_s"] for ph in p0["phases"] if ph["peer"] == "none"])
    rec.add("none_inproc", None, None, "samples_per_s", none_rate, "samples/s")
    for ph in p0["phases"]:
        if ph["peer"] == "none":
            rec.add("none_inproc", None, None, "samples_per_s_phase", ph["samples_per_s"], "samples/s")
    # deltarec: a job spawned like its jobs, without checkpointing
    job_rate = base["samples_per_s"]
    rec.add("none", None, None, "samples_per_s", job_rate, "samples/s")
    summary: dict[str, Any] = {
        "none_samples_per_s": job_rate,
        "none_inproc_samples_per_s": none_rate,
        "peers": {},
        "deltarec": {},
    }

    restore = p0["restore"]
    dcp_load = median_of(restore.get("dcp.load", {}).get("restore_s", []))
    for ph in p0["phases"]:
        name = ph["peer"]
        if name == "none":
            continue
        cks = ph["checkpoints"]
        for c in cks:
            rec.add(name, "full", "fp32", "stall_ms", c["stall_ms"], "ms", c["ckpt"], step=c["step"])
            rec.add(name, "full", "fp32", "bytes_written", c["bytes"], "B", c["ckpt"], step=c["step"])
            rec.add(name, "full", "fp32", "capacity_bytes", c["bytes"], "B", c["ckpt"], step=c["step"])
            rec.add(name, "full", "fp32", "durable_at_step", c["durable_at"], "step", c["ckpt"], step=c["step"])
            rec.add(name, "full", "fp32", "durable_s", c.get("durable_s"), "s", c["ckpt"], step=c["step"])
            rec.add(name, "full", "fp32", "stall_wait_ms", c.get("wait_ms"), "ms", c["ckpt"], step=c["step"])
        loss = steps_lost([(c["step"], c["durable_at"]) for c in cks], interval, steps)
        load_key = {"dcp.save": "dcp.load", "dcp.async_save": "dcp.load", "torch.save": "torch.load"}[name]
        durable = [c["durable_s"] for c in cks if c.get("durable_s") is not None]
        agg = {
            "stall_ms": median_of([c["stall_ms"] for c in cks]),
            "bytes_written": mean_of([c["bytes"] for c in cks]),
            "capacity_bytes": max((c["bytes"] for c in cks), default=None),
            "samples_per_s": ph["samples_per_s"],
            "throughput_overhead": 1 - ph["samples_per_s"] / none_rate if none_rate and ph["samples_per_s"] else None,
            "restore_s": median_of(restore.get(load_key, {}).get("restore_s", [])),
            "steps_lost_mean": loss,
            # checkpoint step to durable (dcp.save: its stall; dcp.async_save: its future done)
            "durable_s": median_of(durable),
            "durable_s_max": max(durable, default=None),
            # dcp.async_save: its stall less the wait for the previous save (staging and planning)
            "stall_blocking_ms": median_of([c["stall_ms"] - c["wait_ms"] for c in cks if "wait_ms" in c]),
        }
        summary["peers"][name] = agg
        _add_agg(rec, name, "full", "fp32", agg)
    for load in ("dcp.load", "torch.load"):
        if restore.get(load, {}).get("same_state"):
            rec.add(load, "full", "fp32", "restore_same_state", all(restore[load]["same_state"]), "bool")
    dcp = summary["peers"].get("dcp.save", {})

    for (policy, enc), run in jobs.items():
        cks = [c for c in run["checkpoints"]]
        cap = run["capacity"]
        for c in cks:
            cid = c["ckpt_id"]
            capb = cap.get(cid)
            rec.add("deltarec", policy, enc, "stall_ms", c["stall_ms"], "ms", cid, step=c["step"], kind=c["kind"])
            rec.add("deltarec", policy, enc, "bytes_written", c["bytes"], "B", cid, step=c["step"], kind=c["kind"])
            rec.add("deltarec", policy, enc, "rows_written", c["rows"], "rows", cid, step=c["step"])
            rec.add("deltarec", policy, enc, "committed", bool(c["committed"]), "bool", cid, step=c["step"])
            if capb:
                rec.add(
                    "deltarec",
                    policy,
                    enc,
                    "capacity_bytes",
                    capb["chain_bytes"] + capb["dense_bytes"],
                    "B",
                    cid,
                    step=c["step"],
                    chain_links=capb["links"],
                    dense_bytes=capb["dense_bytes"],
                )
            rec.add("bare_copy", policy, enc, "stall_ms", c["bare_copy_ms"], "ms", cid, step=c["step"])
            rec.add("deltarec", policy, enc, "durable_at_step", c.get("durable_at_step"), "step", cid, step=c["step"])
            rec.add("deltarec", policy, enc, "learned_at_step", c.get("committed_at_step"), "step", cid, step=c["step"])
            rec.add("deltarec", policy, enc, "durable_s", c.get("durable_s"), "s", cid, step=c["step"], kind=c["kind"])
            rec.add("deltarec", policy, enc, "stall_new_bytes", c.get("stall_new_bytes"), "B", cid, step=c["step"])
        ok = [c for c in cks if c["committed"]]
        caps = [cap[c["ckpt_id"]]["chain_bytes"] + cap[c["ckpt_id"]]["dense_bytes"] for c in ok if c["ckpt_id"] in cap]
        label = f"deltarec:{policy}-{enc}"
        rs = restore.get(label, {})
        if rs.get("same_state"):  # checked where the job's rows are exact (one process, fp32)
            rec.add("deltarec", policy, enc, "restore_same_state", all(rs["same_state"]), "bool")
        agg = {
            "stall_ms": median_of([c["stall_ms"] for c in ok]),
            "bare_copy_ms": median_of([c["bare_copy_ms"] for c in ok]),
            "stall_over_bare_copy": median_of([c["stall_over_bare"] for c in ok]),
            "bytes_written": mean_of([c["bytes"] for c in ok]),
            # between two full checkpoints (the long-run regime of a diff policy; none for `full`)
            "bytes_written_delta": mean_of([c["bytes"] for c in ok if c["kind"] == "delta"]),
            "capacity_bytes": max(caps) if caps else None,
            "capacity_bytes_final": caps[-1] if caps else None,
            "samples_per_s": run["samples_per_s"],
            "throughput_overhead": 1 - run["samples_per_s"] / job_rate if job_rate and run["samples_per_s"] else None,
            "restore_s": median_of(rs.get("restore_s", [])),
            # where the restore's time went (`RestoreReport`), median over the repeats
            **{f"restore_{k}": median_of([p[k] for p in rs.get("parts", [])]) for k in RESTORE_PARTS},
            "steps_lost_mean": steps_lost(
                [(c["step"], c.get("durable_at_step") if c["committed"] else None) for c in cks],
                interval,
                run.get("steps", steps),
            ),
            "committed": len(ok),
            "checkpoints": len(cks),
            "skipped": run.get("skipped", 0),
            # checkpoint step (its stall) to COMMIT, per checkpoint: median and worst
            "durable_s": median_of([c["durable_s"] for c in ok if c.get("durable_s") is not None]),
            "durable_s_max": max((c["durable_s"] for c in ok if c.get("durable_s") is not None), default=None),
        }
        agg.update(checkpoint_cpu(run["cpu"], base["cpu"], len(cks), run.get("broker_cpu_s")))
        agg["steps_lost_vs_dcp"] = (
            agg["steps_lost_mean"] / dcp["steps_lost_mean"]
            if agg["steps_lost_mean"] is not None and dcp.get("steps_lost_mean")
            else None
        )
        agg["bytes_written_vs_dcp"] = ratio(dcp.get("bytes_written"), agg["bytes_written"])
        agg["bytes_written_delta_vs_dcp"] = ratio(dcp.get("bytes_written"), agg["bytes_written_delta"])
        agg["capacity_vs_dcp"] = ratio(dcp.get("capacity_bytes"), agg["capacity_bytes"])
        agg["stall_vs_dcp_save"] = ratio(dcp.get("stall_ms"), agg["stall_ms"])
        agg["restore_over_dcp_load"] = agg["restore_s"] / dcp_load if agg["restore_s"] and dcp_load else None
        if policy == FOLLOWER:
            agg["capacity_final_vs_dcp"] = (
                dcp["capacity_bytes"] / agg["capacity_bytes_final"] if agg["capacity_bytes_final"] else None
            )
            summary.setdefault("follower", {})[enc] = _follower_records(rec, enc, run, ok, agg, dcp, rs)
        summary["deltarec"][f"{policy}/{enc}"] = agg
        _add_agg(rec, "deltarec", policy, enc, agg)
    return rec, summary


def _follower_records(
    rec: PeerRecords,
    enc: str,
    run: dict[str, Any],
    ok: list[dict],
    agg: dict[str, Any],
    dcp: dict[str, Any],
    restore: dict[str, Any],
) -> dict[str, Any]:
    """The follower's own figures (peer `follower`, policy `incremental+follower`) beside the
    trainer's: per compaction and per applied checkpoint, then aggregated; returns the
    aggregates (the summary's `follower/<encoding>`)."""
    fol = run["follower"]
    compactions, applied = fol["compactions"], fol["applied"]
    for c in compactions:
        cid = c["compacted_ckpt"]
        rec.add(
            "follower",
            FOLLOWER,
            enc,
            "compact_bytes",
            c["compact_bytes"],
            "B",
            cid,
            step=c["step"],
            replaced_links=c["compact_replaced_links"],
            replaced_bytes=c["compact_replaced_bytes"],
        )
        rec.add("follower", FOLLOWER, enc, "compact_s", c["compact_s"], "s", cid, step=c["step"])
    for a in applied:
        cid = a["follow_ckpt"]
        rec.add("follower", FOLLOWER, enc, "follow_lag_ckpts", a["follow_lag_ckpts"], "checkpoints", cid, step=a["step"])
        rec.add("follower", FOLLOWER, enc, "follow_lag_s", a["follow_lag_s"], "s", cid, step=a["step"])
        rec.add(
            "follower",
            FOLLOWER,
            enc,
            "follow_apply_s",
            a["follow_apply_s"],
            "s",
            cid,
            step=a["step"],
            rebuilt=a["follow_rebuilt"],
        )
    for cid, capb in sorted(run["capacity"].items()):
        rec.add(
            "deltarec",
            FOLLOWER,
            enc,
            "capacity_chain_links",
            capb["links"],
            "links",
            cid,
            from_compacted=capb["from_compacted"],
            marker_from_compacted=capb["marker_from_compacted"],
        )
    n = len(ok)
    trainer_total = sum(c["bytes"] for c in ok)
    follower_total = sum(c["compact_bytes"] for c in compactions)
    total_per_interval = (trainer_total + follower_total) / n if n else None
    restored = restore.get("checkpoint", {})
    newest = run["capacity"].get(max(run["capacity"], default=-1), {})
    lag_c = [a["follow_lag_ckpts"] for a in applied]
    lag_s = [a["follow_lag_s"] for a in applied]
    out = {
        "intervals": n,
        "trainer_bytes_total": trainer_total,
        "trainer_bytes_per_interval": agg["bytes_written"],
        "trainer_bytes_per_interval_delta": agg["bytes_written_delta"],
        "follower_bytes_total": follower_total,
        "follower_bytes_per_interval": follower_total / n if n else None,
        "total_bytes_per_interval": total_per_interval,
        "total_bytes_vs_dcp": dcp["bytes_written"] / total_per_interval if total_per_interval else None,
        "follower_read_bytes_total": sum(a["follow_read_bytes"] for a in applied),
        "compactions": len(compactions),
        "compact_s_median": median_of([c["compact_s"] for c in compactions]),
        "rebased_commits": sum(1 for c in run["capacity"].values() if c["marker_from_compacted"]),
        "follow_applied": len(applied),
        "follow_rebuilds": sum(1 for a in applied if a["follow_rebuilt"]),
        "follow_lag_ckpts_mean": mean_of(lag_c),
        "follow_lag_ckpts_max": max(lag_c, default=None),
        "follow_lag_s_median": median_of(lag_s),
        "follow_lag_s_max": max(lag_s, default=None),
        "follow_catch_up_s": fol["catch_up_s"],
        "follower_caught_up": fol["caught_up"],
        "follower_error": fol["error"],
        "capacity_bytes_final": agg["capacity_bytes_final"],
        "capacity_final_links": newest.get("links"),
        "capacity_final_from_compacted": newest.get("from_compacted"),
        "capacity_final_vs_dcp": agg.get("capacity_final_vs_dcp"),
        "capacity_vs_dcp": agg["capacity_vs_dcp"],
        "restore_s": agg["restore_s"],
        "restore_over_dcp_load": agg["restore_over_dcp_load"],
        "restore_chain_links": len(restored["chain"]) if restored.get("chain") else None,
        "restore_chain": "+".join(str(c) for c in restored.get("chain", [])) or None,
        "restore_bytes": restored.get("bytes"),
    }
    for k, v in out.items():
        rec.add("follower", FOLLOWER, enc, k, v, "bool" if isinstance(v, bool) else _UNITS.get(k) or unit_of(k) or "")
    return out


_UNITS = {
    "stall_ms": "ms",
    "stall_blocking_ms": "ms",
    "bare_copy_ms": "ms",
    "bytes_written": "B",
    "bytes_written_delta": "B",
    "capacity_bytes": "B",
    "capacity_bytes_final": "B",
    "samples_per_s": "samples/s",
    "throughput_overhead": "fraction",
    "restore_s": "s",
    "steps_lost_mean": "steps",
    "durable_s": "s",
    "durable_s_max": "s",
    "committed": "checkpoints",
    "checkpoints": "checkpoints",
    "skipped": "checkpoints",
    "intervals": "checkpoints",
    "compactions": "checkpoints",
    "follow_applied": "passes",  # a pass applies one or more checkpoints (the follower's record of each)
    "follow_rebuilds": "checkpoints",
    "rebased_commits": "checkpoints",
    "follow_lag_ckpts_mean": "checkpoints",
    "follow_lag_ckpts_max": "checkpoints",
    "capacity_final_links": "links",
    "restore_chain_links": "links",
    "restore_chain": "checkpoint ids",
    "follower_error": "text",
}


CPU_PARTS = ("train", "stall", "writer", "kafka", "other", "trainer", "broker")
_UNITS.update({f"cpu_{k}_s_per_ckpt": "s/checkpoint" for k in CPU_PARTS}, cpu_trainer_overhead="fraction")


def _add_agg(rec: PeerRecords, peer: str, policy: str, enc: str, agg: dict[str, Any]) -> None:
    for k, v in agg.items():
        rec.add(peer, policy, enc, k, v, _UNITS.get(k, "ratio"))


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    d = summary["deltarec"].get(f"{DEFAULT_POLICY}/{DEFAULT_QUANT}", {})
    out = [
        ("bytes written per interval, dcp.save / deltarec (default policy, 4-bit)", d.get("bytes_written_vs_dcp"), ">=", 17),
        ("capacity, dcp.save / deltarec (default policy, 4-bit)", d.get("capacity_vs_dcp"), ">=", 8),
        ("stall, dcp.save / deltarec (default policy, 4-bit)", d.get("stall_vs_dcp_save"), ">=", 20),
        ("stall, deltarec / bare copy of the same rows", d.get("stall_over_bare_copy"), "<=", 1.2),
        ("throughput overhead (at this suite's interval, not 1 minute)", d.get("throughput_overhead"), "<=", 0.05),
        ("restore / dcp.load", d.get("restore_over_dcp_load"), "<=", 1.0),
        ("steps lost on a crash, deltarec (default policy, 4-bit) / dcp.save", d.get("steps_lost_vs_dcp"), "<=", 1.5),
    ]
    f = summary.get("follower", {}).get(DEFAULT_QUANT)
    if f is not None:  # deltarec + follower, 4-bit rows
        out += [
            (
                "trainer bytes per interval, dcp.save / deltarec+follower deltas (4-bit, one full then only deltas)",
                f["trainer_bytes_per_interval_delta"] and d_vs(summary, f["trainer_bytes_per_interval_delta"]),
                ">=",
                17,
            ),
            (
                f"trainer bytes per interval, dcp.save / deltarec+follower mean of {f['intervals']} intervals incl. "
                "the one full (4-bit)",
                f["trainer_bytes_per_interval"] and d_vs(summary, f["trainer_bytes_per_interval"]),
                ">=",
                17,
            ),
            (
                "capacity, dcp.save / newest restorable (cheapest) chain with a follower (4-bit)",
                f["capacity_final_vs_dcp"],
                ">=",
                8,
            ),
            ("restore of that chain / dcp.load (4-bit, with a follower)", f["restore_over_dcp_load"], "<=", 1.0),
        ]
    return [
        {"target": t, "value": v, "op": op, "goal": g, "met": None if v is None else (v >= g if op == ">=" else v <= g)}
        for t, v, op, g in out
    ]


def d_vs(summary: dict[str, Any], nbytes: float) -> float | None:
    """dcp.save's bytes per interval / `nbytes`."""
    dcp = summary["peers"].get("dcp.save", {}).get("bytes_written")
    return dcp / nbytes if dcp and nbytes else None


# -- output ----------------------------------------------------------------------------------------
def _percent(x: float | None) -> float | None:
    return None if x is None else x * 100


def table(summary: dict[str, Any]) -> str:
    head = (
        "| peer | policy / encoding | stall ms | bytes written / interval MB | capacity MB | samples/s | overhead | "
        "restore s | steps lost | durable s (median / max) | bytes vs dcp | capacity vs dcp | stall vs dcp | "
        "stall / bare copy |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]

    def f(x: Any, nd: int = 2, scale: float = 1.0) -> str:
        return "" if x is None else f"{x / scale:.{nd}f}"

    def durable(a: dict[str, Any]) -> str:
        return "" if a.get("durable_s") is None else f"{f(a['durable_s'], 2)} / {f(a.get('durable_s_max'), 2)}"

    for name, a in summary["peers"].items():
        lines.append(
            f"| {name} | full / fp32 | {f(a['stall_ms'], 1)} | {f(a['bytes_written'], 1, 1e6)} | "
            f"{f(a['capacity_bytes'], 1, 1e6)} | {f(a['samples_per_s'], 0)} | {f(_percent(a['throughput_overhead']), 1)}% | "
            f"{f(a['restore_s'], 3)} | {f(a['steps_lost_mean'], 1)} | {durable(a)} | 1 | 1 | | |"
        )
    for key, a in summary["deltarec"].items():
        ov = a["throughput_overhead"]
        lines.append(
            f"| deltarec | {key.replace('/', ' / ')} | {f(a['stall_ms'], 1)} | {f(a['bytes_written'], 2, 1e6)} | "
            f"{f(a['capacity_bytes'], 2, 1e6)} | {f(a['samples_per_s'], 0)} | {f(ov * 100 if ov is not None else None, 1)}% | "
            f"{f(a['restore_s'], 3)} | {f(a['steps_lost_mean'], 1)} | "
            f"{f(a['durable_s'], 2)} / {f(a['durable_s_max'], 2)} | {f(a['bytes_written_vs_dcp'], 1)} | "
            f"{f(a['capacity_vs_dcp'], 1)} | {f(a['stall_vs_dcp_save'], 1)} | {f(a['stall_over_bare_copy'], 2)} |"
        )
    lines.append(f"| none (job, deltarec's baseline) | | | | | {f(summary['none_samples_per_s'], 0)} | 0% | | | | | | | |")
    lines.append(
        f"| none (in-process, the peers' baseline) | | | | | {f(summary['none_inproc_samples_per_s'], 0)} | 0% | | | | | | | |"
    )
    return "\n".join(lines)


def cpu_table(summary: dict[str, Any]) -> str:
    """CPU seconds per checkpoint of every deltarec job beyond the job without checkpoints,
    summed over ranks, by thread class, and the broker's beside them (a fresh broker per job)."""
    head = (
        "| deltarec job | training thread (of it in stalls) | writer, copier and host-buffer threads | librdkafka "
        "| other threads | trainer process | broker process | trainer CPU overhead |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]

    def f(x: Any, nd: int = 3) -> str:
        return "" if x is None else f"{x:.{nd}f}"

    for key, a in summary["deltarec"].items():
        if "cpu_trainer_s_per_ckpt" not in a:
            continue
        ov = a["cpu_trainer_overhead"]
        lines.append(
            f"| {key.replace('/', ' / ')} | {f(a['cpu_train_s_per_ckpt'])} ({f(a['cpu_stall_s_per_ckpt'])}) | "
            f"{f(a['cpu_writer_s_per_ckpt'])} | {f(a['cpu_kafka_s_per_ckpt'])} | {f(a['cpu_other_s_per_ckpt'])} | "
            f"{f(a['cpu_trainer_s_per_ckpt'])} | {f(a['cpu_broker_s_per_ckpt'])} | "
            f"{f(ov * 100 if ov is not None else None, 1)}% |"
        )
    return "\n".join(lines)


def follower_table(summary: dict[str, Any]) -> str:
    """deltarec + follower against dcp.save / dcp.load: the trainer's bytes and the follower's
    beside them, the newest restorable chain, its restore, the follower's lag."""
    fol = summary.get("follower", {})
    if not fol:
        return ""
    dcp = summary["peers"]["dcp.save"]
    head = (
        "| incremental + follower | intervals | trainer MB / interval (all / deltas) | follower MB / interval "
        "(compactions) | total MB / interval | newest chain MB (links) | restore s (links) | "
        "lag ckpts mean / max | lag s median / max | trainer vs dcp (all / deltas) | total vs dcp | "
        "capacity vs dcp | restore / dcp.load |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]

    def f(x: Any, nd: int = 2, scale: float = 1.0) -> str:
        return "" if x is None else f"{x / scale:.{nd}f}"

    lines.append(
        f"| dcp.save / dcp.load | | {f(dcp['bytes_written'], 1, 1e6)} | | {f(dcp['bytes_written'], 1, 1e6)} | "
        f"{f(dcp['capacity_bytes'], 1, 1e6)} | {f(dcp['restore_s'], 3)} | | | 1 | 1 | 1 | 1 |"
    )
    for enc, a in fol.items():
        tvd = d_vs(summary, a["trainer_bytes_per_interval"])
        tvdd = d_vs(summary, a["trainer_bytes_per_interval_delta"])
        lines.append(
            f"| {enc} | {a['intervals']} | {f(a['trainer_bytes_per_interval'], 2, 1e6)} / "
            f"{f(a['trainer_bytes_per_interval_delta'], 2, 1e6)} | {f(a['follower_bytes_per_interval'], 2, 1e6)} "
            f"({a['compactions']}) | {f(a['total_bytes_per_interval'], 2, 1e6)} | "
            f"{f(a['capacity_bytes_final'], 2, 1e6)} ({a['capacity_final_links']}) | {f(a['restore_s'], 3)} "
            f"({a['restore_chain_links']}) | "
            f"{f(a['follow_lag_ckpts_mean'], 2)} / {a['follow_lag_ckpts_max']} | {f(a['follow_lag_s_median'], 2)} / "
            f"{f(a['follow_lag_s_max'], 2)} | {f(tvd, 1)} / {f(tvdd, 1)} | {f(a['total_bytes_vs_dcp'], 1)} | "
            f"{f(a['capacity_final_vs_dcp'], 1)} | {f(a['restore_over_dcp_load'], 2)} |"
        )
    return "\n".join(lines)


def plots(records: PeerRecords, img: Path, size: str, encodings: tuple[str, ...] = ENCODINGS) -> list[str]:
    """Check-N-Run's Figures 15 and 16 in shape: per interval, bytes written and storage
    required by every deltarec policy (one panel per encoding) against dcp.save's mean."""
    from matplotlib.ticker import MaxNLocator

    written = []
    for metric, fig_no, title in (
        ("bytes_written", 15, "bytes written per interval"),
        ("capacity_bytes", 16, "storage required per interval"),
    ):
        path = img / f"peers_{size}_fig{fig_no}_{metric}.png"
        with figure(path, 1, len(encodings), figsize=(11, 4), dpi=100, sharey=True, squeeze=False) as (fig, grid):
            axes = grid[0]
            for ax, enc in zip(axes, encodings):
                for policy in (*POLICIES, FOLLOWER):
                    pts = records.series(metric, peer="deltarec", policy=policy, encoding=enc)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], marker="o", label=policy)
                dcp = mean_of(v for _, v in records.series(metric, peer="dcp.save"))
                if dcp is not None:
                    ax.axhline(dcp / 1e6, color="k", ls="--", label="dcp.save (fp32, full)")
                ax.set_title(f"{enc}")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.set_xlabel("checkpoint (interval) number")
                ax.grid(alpha=0.3)
            axes[0].set_ylabel("MB")
            axes[0].legend(fontsize=8)
            fig.suptitle(f"Check-N-Run Fig. {fig_no} shape: {title} ({size} suite)")
        written.append(str(path))
    return written


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="quick", help="the model and steps (the suite's name)")
    p.add_argument("--out", type=Path, help="write the JSON records and summary here")
    p.add_argument("--plots", type=Path, help="write the Figure 15/16 PNGs into this directory")
    p.add_argument("--keep", type=Path, help="keep run directories here (default: a temporary directory)")
    p.add_argument("--steps", type=int, help="override the suite's training steps (per job and per peer phase)")
    p.add_argument("--interval", type=int, help="override the suite's checkpoint interval (steps)")
    p.add_argument("--repeats", type=int, help="override the suite's rounds of restores (the median is reported)")
    p.add_argument(
        "--restore-build-s",
        type=float,
        help="seconds each deltarec restore keeps the rank busy, standing in for a restarted job's model build, "
        "before it restores (default: the job's own build, measured; 0: no wait)",
    )
    p.add_argument(
        "--encodings",
        nargs="+",
        choices=ENCODINGS,
        default=list(ENCODINGS),
        help="row encodings of the deltarec jobs (default: all)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help="checkpoint policies of the deltarec jobs (default: all; the targets are the default policy's)",
    )
    p.add_argument(
        "--follower-intervals",
        type=int,
        help="checkpoints of the deltarec + follower jobs (default: the suite's; 0: leave them out)",
    )
    p.add_argument(
        "--follower-grace-s",
        type=float,
        default=300,
        help="how long the follower may take, once training ended, to apply the newest COMMIT",
    )
    p.add_argument("--timeout-s", type=float, default=900)
    return p


def run(argv: list[str], prog: str = "python -m bench.run") -> dict[str, Any]:
    """Measure, print the table and targets, (`--out`) write the result document; return it
    (its `records` as `Measurement`s)."""
    args = parser(prog).parse_args(argv)
    started = time.perf_counter()
    machine = machine_info()
    s = dict(SIZES[args.size])
    s.update({k: v for k, v in (("steps", args.steps), ("interval", args.interval), ("repeats", args.repeats)) if v})
    prefix = f"bench-{args.size}-{uuid.uuid4().hex[:8]}"
    # a fresh broker per job, kept until the peers' phase has restored every job from its own
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmpdir, contextlib.ExitStack() as brokers:

        def broker() -> EmbeddedBroker:
            return brokers.enter_context(EmbeddedBroker())

        work = args.keep / prefix if args.keep else Path(tmpdir)
        work.mkdir(parents=True, exist_ok=True)
        s["config"] = (
            str(full_config(work / "full.yaml", s["cap"], s["dim"])) if s["config"] is None else config_path(s["config"])
        )
        log(
            f"suite {args.size}: {s['config']}, {s['steps']} steps, checkpoint every {s['interval']}; a fresh broker "
            f"per job; work dir {work}"
        )
        base = baseline_job(s, work, args.timeout_s)
        jobs: dict[tuple[str, str], dict] = {}
        encodings = tuple(args.encodings)
        for policy in args.policies:
            for enc in encodings:
                jobs[(policy, enc)] = deltarec_job(policy, enc, s, work, broker(), prefix, args.timeout_s)
        intervals = s["follower_intervals"] if args.follower_intervals is None else args.follower_intervals
        if intervals > 0:
            for enc in encodings:
                jobs[(FOLLOWER, enc)] = follower_job(
                    enc, s, work, broker(), prefix, args.timeout_s, intervals, args.follower_grace_s
                )
        peers = peers_job(s, work, jobs, args.timeout_s, build_s=args.restore_build_s)
        batch = _batch(s)
    machine["loadavg_end"] = loadavg()
    records, summary = build_records(s, jobs, peers, base)
    tg = targets(summary)
    model_rows = next(iter(jobs.values()))["model_rows"]
    result: dict[str, Any] = {
        **document_head("peers", prog, argv, machine),
        "suite": args.size,
        "settings": {
            "config": s["config"],
            "steps": s["steps"],
            "interval_steps": s["interval"],
            "ranks": 2,
            "encodings": list(encodings),
            "policies": list(args.policies),
            "overrides": s["overrides"],
            "model_rows": model_rows,
            "follower_intervals": next((r["steps"] // s["interval"] for (pol, _), r in jobs.items() if pol == FOLLOWER), 0),
            "follower": next((r["follower"]["settings"] for (pol, _), r in jobs.items() if pol == FOLLOWER), None),
            "interval_s_approx": s["interval"] * 2 * batch / summary["none_samples_per_s"]
            if summary["none_samples_per_s"]
            else None,
        },
        "wall_s": time.perf_counter() - started,
        "records": records.items,
        "summary": summary,
        "targets": tg,
    }
    if args.plots:
        result["plots"] = plots(records, args.plots, args.size, encodings)
    result["wall_s"] = time.perf_counter() - started
    print(table(summary))
    if summary.get("follower"):
        print()
        print(follower_table(summary))
    print("\nCPU seconds per checkpoint beyond the job without checkpoints (both ranks):")
    print(cpu_table(summary))
    for t in tg:
        v = t["value"]
        print(
            f"target: {t['target']} {t['op']} {t['goal']}: {'n/a' if v is None else f'{v:.3g}'} "
            f"({'met' if t['met'] else 'NOT met' if t['met'] is not None else 'not measured'})"
        )
    print(f"wall {result['wall_s']:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({**result, "records": [m.flat() for m in records.items]}, indent=1) + "\n")
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """Every record of the run, as measured (per checkpoint and aggregated)."""
    return list(result["records"])


def _batch(s: dict[str, Any]) -> int:
    from trainer.config import load_config

    return load_config(s["config"], s["overrides"], check_data=False).data.batch_size


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.peers")
    return 0


if __name__ == "__main__":
    run_main(main)
