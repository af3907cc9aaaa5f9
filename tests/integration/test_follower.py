"""`deltarec-follow` against real jobs: compaction under crashes, 4-bit compaction, serving
snapshots and the lease between two followers.

Everything is a real process: gloo ranks (launch/ranks.py), the follower as
`python -m trainer.follow_cli`, real stream files or the embedded broker. Random choices
(where the trainer dies, when the follower dies) come from the test's seed; a failure names
the command that replays them (`DELTAREC_TEST_SEED=<seed> ...`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt import cli as ckpt_cli
from ckpt.config import CkptConfig
from ckpt.dense.store import DenseRef, DenseStore
from ckpt.log.backend import open_backend
from ckpt.log.catalog import Catalog, read_catalog
from ckpt.log.markers import ChainLink, LeaseRecord, Marker, decode_record, encode_marker
from ckpt.restore.export import assemble, replicated_tables
from ckpt.restore.replay import iter_chain_frames
from ckpt.stream.sink import generation_label, is_compacted
from launch.ranks import RankGroup, read_jsonl, spawn_ranks, start_ranks
from sharding.plan import EBC_PATH, table_key
from sharding.process_group import DistEnv
from tests.background import BackgroundProc
from trainer.ckpt_cli import load_job_ckpt_config
from trainer.data.factory import make_reader
from trainer.model import build_model

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig, MetricsReader, ReplaySeed

pytestmark = pytest.mark.integration

STEPS = 60  # the crash test's job: 12 checkpoints, one full then deltas
LEASE_S = 1.5
FOLLOW = ["ckpt.follow.poll_s=0.2", f"ckpt.follow.lease_s={LEASE_S}"]


def _job(run_id: str, sink: str = "filesystem", bootstrap: str = "", encoding: str = "fp32") -> list[str]:
    job = [
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.policy=incremental",
        "ckpt.schedule.interval_steps=5",
        "ckpt.sink.flush_timeout_s=20",
        f"ckpt.encoding.weights={encoding}",
        *FOLLOW,
        "train.eval_batches=1",
        "train.save_params=true",
    ]
    return [*job, f"ckpt.sink.bootstrap_servers={bootstrap}"] if bootstrap else job


# --- the follower as a process ----------------------------------------------------------------


class FollowerProc(BackgroundProc):
    """One `python -m trainer.follow_cli` of the job, its output in `<tmp>/<name>.log`."""

    def __init__(self, config: Path, job: list[str], tmp_path: Path, name: str, *args: str) -> None:
        argv = ["--config", str(config), f"run.dir={tmp_path / 'run'}", *job, *args]
        super().__init__("trainer.follow_cli", argv, tmp_path, name)


def _owner_pid(follower_id: str) -> int:
    """The pid inside a follower id (host:pid:random)."""
    return int(follower_id.rsplit(":", 2)[1])


def _wait_for(
    predicate: Callable[[], object],
    timeout_s: float,
    what: str,
    followers: tuple[FollowerProc, ...] = (),
    group: RankGroup | None = None,
) -> None:
    """Poll `predicate` until true; fail after `timeout_s` (or when a watched follower died)
    showing the followers' logs."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        dead = [f for f in followers if not f.alive()]
        if dead or time.monotonic() > deadline:
            why = f"{dead[0].name} exited" if dead else f"timed out after {timeout_s:.0f} s"
            logs = "\n".join(f.tail() for f in followers)
            ranks = ""
            if group is not None:
                for rank, (_out, err) in enumerate(group.logs):
                    err.flush()
                    ranks += f"\n--- rank {rank} ---\n{Path(err.name).read_text()[-1500:]}"
            pytest.fail(f"waiting for {what}: {why}\n{logs}{ranks}", pytrace=False)
        time.sleep(0.1)  # polling files another process writes


# --- reading what the run left ----------------------------------------------------------------


def _ckpt_config(debug_config: DebugConfig, job: list[str], run_dir: Path) -> CkptConfig:
    return debug_config.load([*job, f"run.dir={run_dir}"], check_data=False).ckpt


def _catalog(cfg: CkptConfig) -> Catalog:
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        return read_catalog(backend.markers, cfg.run_id)
    finally:
        backend.close()


def _lease_history(cfg: CkptConfig) -> tuple[list[tuple[int, str, float]], list[LeaseRecord]]:
    """(accepted claims as (epoch, holder, claim time), every lease record), by folding the
    markers log one record at a time the way every reader does."""
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        records = backend.markers.read_markers()
    finally:
        backend.close()
    catalog = Catalog(cfg.run_id)
    accepted, leases = [], []
    for pos, data in records:
        rec = decode_record(data)
        epochs = catalog.epochs
        catalog.feed([(pos, data)])
        if isinstance(rec, LeaseRecord) and rec.run_id == cfg.run_id:
            leases.append(rec)
            if catalog.epochs != epochs:
                accepted.append((catalog.epochs, rec.follower, rec.created_unix))
    return accepted, leases


def _follower_records(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "follower.jsonl", live=True)


def _original_chain(catalog: Catalog, chain: list[ChainLink]) -> list[ChainLink]:
    """`chain` with every compacted baseline replaced by the trainer's own chain of that
    checkpoint (recursively): the links the trainer wrote, from its full checkpoint on."""
    if not chain or not is_compacted(chain[0].generation):
        return list(chain)
    base = catalog.commits[chain[0].checkpoint_id]
    return [*_original_chain(catalog, base.chain), *chain[1:]]


def _tables(marker: Marker, chain: list[ChainLink], cfg: CkptConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Full tables of `marker`'s checkpoint replayed from `chain`."""
    m = replace(marker, chain=chain)
    state = DenseStore(Path(cfg.sink.dense_dir)).read(DenseRef.from_json(marker.dense))
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        frames = [(link.full, f) for link, f in iter_chain_frames(m, backend.source, cfg.run_id, backend.locate)]
        return assemble(m, frames, replicated_tables(m, state))
    finally:
        backend.close()


def _assert_same_tables(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for table, tensors in want.items():
        assert got[table].keys() == tensors.keys(), f"{what}: table {table}"
        for name, value in tensors.items():
            assert torch.equal(got[table][name], value), f"{what}: table {table} {name} differs"


def _train_40_steps_followed(
    debug_config: DebugConfig, job: list[str], tmp_path: Path, cfg: CkptConfig, *follow_args: str, pace_s: float = 0.0
) -> int:
    """Train 40 steps with a follower running; stop it once it applied the last checkpoint,
    whose id is returned. `pace_s`: each checkpoint's copy starts that late, and the next step
    waits for it (DELTAREC_SLOW_COPY), so a follower polling faster sees each checkpoint alone
    rather than several at once in a chain, even on a busy machine."""
    follower = FollowerProc(debug_config.path, job, tmp_path, "follower", *follow_args)
    try:
        _wait_for(lambda: "following run" in follower.text(), 60, "the follower to start", (follower,))
        pace = {"DELTAREC_SLOW_COPY": f"*:{pace_s}"} if pace_s else None
        spawn_ranks(debug_config.path, [*job, "train.steps=40"], tmp_path, timeout_s=180, env_extra=pace)
        last = max(_catalog(cfg).commits)
        _wait_for(
            lambda: f"checkpoint {last} (step 40) applied" in follower.text(),
            60,
            f"the follower applying checkpoint {last}",
            (follower,),
        )
        assert follower.stop() == 0, follower.tail()
    finally:
        follower.kill()
    return last


def _dumps(run_dir: Path, ranks: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(ranks)]


# --- 1. crashes of the trainer and of the follower ---------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory, debug_config: DebugConfig) -> list[dict[str, torch.Tensor]]:
    """The job uninterrupted, no follower: incremental checkpoints every 5 steps."""
    tmp = tmp_path_factory.mktemp("reference")
    spawn_ranks(debug_config.path, [*_job("reference"), *SYNCED, f"train.steps={STEPS}"], tmp, timeout_s=180)
    return _dumps(tmp / "run")


# Where the trainer dies (SIGKILL of one rank, as in test_resume.py) -> range of the key: a
# step for "step", else a checkpoint id ("committed": once that rank learns K committed, so
# the crash lands while K+1 is being written). SYNCED keeps the writers at most two
# checkpoints behind training, so each point leaves at least 3 COMMITs (a chain the follower
# compacts) and the crash lands before the last step.
POINTS = {
    "step": (31, 50),
    "snapshot": (7, 10),
    "rows": (7, 10),
    "marker": (7, 10),
    "committed": (3, 8),
}
SYNCED = ["ckpt.write.on_backpressure=wait", "ckpt.write.max_pending_bytes=152000"]  # one full snapshot of rank 0


@pytest.mark.parametrize("sink", ["filesystem", "kafka"])
def test_trainer_and_follower_killed_resume_is_bit_exact_from_compacted_chain(
    tmp_path,
    request,
    sink,
    unique_name,
    reference,
    debug_config: DebugConfig,
    metrics: MetricsReader,
    replay_seed: ReplaySeed,
):
    rng = replay_seed.rng()
    point = rng.choice(sorted(POINTS))
    key = rng.randint(*POINTS[point])
    rank = 0 if point == "marker" else rng.randint(0, 1)
    phase = rng.choice(["training", "after_crash", "resumed"])  # when the first follower dies
    after_ckpt = rng.randint(3, 6)  # "training": once it applied this checkpoint (and compacted once)
    delay = rng.uniform(0.0, 0.4)  # ... and this much later
    why = f"trainer rank {rank} killed at {point}:{key}, follower killed {phase} (+{delay:.2f} s), {replay_seed}"
    print(why)
    bootstrap = request.getfixturevalue("broker").bootstrap if sink == "kafka" else ""
    job = [*_job(unique_name("follow"), sink, bootstrap), *SYNCED]
    run_dir = tmp_path / "run"
    cfg = _ckpt_config(debug_config, job, run_dir)
    followers: list[FollowerProc] = []
    groups: list[RankGroup] = []
    try:
        first = FollowerProc(debug_config.path, job, tmp_path, "follower1")
        followers.append(first)
        crashed = start_ranks(
            debug_config.path,
            [*job, f"train.steps={STEPS}"],
            tmp_path,
            timeout_s=180,
            env_extra={"DELTAREC_KILL_AT": f"{point}:{key}@{rank}"},
        )
        groups.append(crashed)

        def compacted_once() -> bool:
            return any("compacted_ckpt" in r for r in _follower_records(run_dir))

        def restart_follower() -> FollowerProc:
            time.sleep(delay)
            first.kill()
            second = FollowerProc(debug_config.path, job, tmp_path, "follower2")
            followers.append(second)
            return second

        second = None
        if phase == "training":  # once it compacted and applied `after_ckpt` (or the trainer is gone)
            _wait_for(
                lambda: (
                    compacted_once()
                    and (not crashed.running() or any(r.get("follow_ckpt", 0) >= after_ckpt for r in _follower_records(run_dir)))
                ),
                120,
                f"follower1 compacting and applying checkpoint {after_ckpt} ({why})",
                (first,),
                crashed,
            )
            second = restart_follower()
        results = crashed.wait(expect_ok=False)
        assert results[rank].returncode == -9, f"{why}: the trainer did not die by SIGKILL ({results[rank].returncode})"
        if phase == "after_crash":
            _wait_for(compacted_once, 60, f"a compaction ({why})", (first,))
            second = restart_follower()

        # Before resuming: some compaction is accepted and the newest checkpoint restores through it.
        def resume_reads_compacted() -> bool:
            catalog = _catalog(cfg)
            newest = catalog.restorable()
            return bool(newest) and is_compacted(newest[0].chain[0].generation)

        _wait_for(
            resume_reads_compacted,
            60,
            f"a compacted baseline under the newest checkpoint ({why})",
            tuple(f for f in followers if f is not first or phase == "resumed"),
        )
        before = _catalog(cfg)
        newest_before = max(before.commits)

        resumed = start_ranks(
            debug_config.path, [*job, f"train.steps={STEPS}", "ckpt.restore.resume=latest"], tmp_path, timeout_s=180
        )
        groups.append(resumed)
        if phase == "resumed":
            _wait_for(
                lambda: not resumed.running() or any(r.get("follow_ckpt", 0) > newest_before for r in _follower_records(run_dir)),
                120,
                f"follower1 applying a checkpoint of the resumed run ({why})",
                (first,),
                resumed,
            )
            second = restart_follower()
        out = resumed.wait()
        assert second is not None

        final = _catalog(cfg)
        last = max(final.commits)
        assert final.commits[last].step == STEPS, why
        _wait_for(
            lambda: f"checkpoint {last} (step {STEPS}) applied" in second.text(),
            60,
            f"follower2 applying the final checkpoint {last} ({why})",
            (second,),
        )
        # follower1 died without releasing: follower2 gets the lease once lease_s passed
        _wait_for(
            lambda: "holding the compaction lease (epoch 2)" in second.text(),
            30,
            f"follower2 taking the lease over ({why})",
            (second,),
        )
        assert second.stop() == 0, f"{why}\n{second.tail()}"
        assert "stopped:" in second.text(), second.tail()
    finally:
        for f in followers:
            f.kill()
        for g in groups:
            if g.running():  # the test failed while ranks ran: stop them now, not at their deadline
                for p in g.procs:
                    if p.poll() is None:
                        p.kill()
                g.wait(expect_ok=False)

    # (a) bit-exact: the same final parameters as the job never interrupted
    for r, (got, want) in enumerate(zip(_dumps(run_dir), reference)):
        assert got.keys() == want.keys(), why
        for name in want:
            assert torch.equal(got[name], want[name]), f"{why}: rank {r} {name} differs from the uninterrupted run"

    # (b) compactions were accepted, none fenced (a SIGKILLed follower publishes nothing)
    catalog = _catalog(cfg)
    assert catalog.compactions, f"{why}: no compaction accepted"
    assert not catalog.fenced, f"{why}: fenced compactions {[m.checkpoint_id for m in catalog.fenced]}"
    assert any("compacted_ckpt" in r for r in _follower_records(run_dir)), why

    # (c) the resume read the compacted baseline plus the deltas after it, not the whole chain
    restore = metrics(run_dir, "restore_chain")
    assert len(restore) == 1, f"{why}: {restore}"
    chain, restored = restore[0]["restore_chain"], restore[0]["restored_ckpt"]
    line = [x for x in out[0].stdout.splitlines() if x.startswith("deltarec: resumed from checkpoint")]
    assert line and f"resumed from checkpoint {restored} " in line[0] and f"(chain {chain}:" in line[0], (why, line)
    assert restore[0]["step"] < STEPS, f"{why}: the crash came after the last step, nothing was trained after it"
    if point == "committed":
        assert restored >= key, f"{why}: resumed from checkpoint {restored}, but {key} had committed"
    elif point != "step":
        assert restored < key, f"{why}: resumed from checkpoint {restored}, which had no COMMIT marker"
    assert chain[-1] == restored and chain[0] in catalog.compactions, f"{why}: chain {chain} does not start compacted"
    assert not catalog.commits[chain[0]].full, f"{why}: chain {chain}"
    full_ids = [cid for cid, m in catalog.commits.items() if m.full and cid <= restored]
    since_full = restored - max(full_ids) + 1  # links of the trainer's own chain of `restored`
    assert len(chain) < since_full, f"{why}: restore read {chain}, the trainer's chain has {since_full} links"
    assert len(_original_chain(catalog, catalog.cheapest(catalog.commits[restored]).chain)) == since_full, why

    # (d) the restarted follower waited out the lease of the killed one, then held it
    accepted, leases = _lease_history(cfg)
    assert [(e, _owner_pid(h)) for e, h, _ in accepted] == [(1, first.pid), (2, second.pid)], f"{why}: {accepted}"
    assert not any(r.event == "release" and _owner_pid(r.follower) == first.pid for r in leases), why
    first_last = max(r.created_unix for r in leases if _owner_pid(r.follower) == first.pid)
    waited = accepted[1][2] - first_last
    assert waited > LEASE_S, f"{why}: follower2 took the lease {waited:.2f} s after follower1's last renewal"
    writers = {_owner_pid(m.follower) for m in catalog.compactions.values()}
    assert first.pid in writers and writers <= {first.pid, second.pid}, f"{why}: compactions by {writers}"
    for cid, m in catalog.compactions.items():
        label = generation_label(m.chain[0].generation)
        assert label == f"e{1 if _owner_pid(m.follower) == first.pid else 2}.c{cid}", f"{why}: compaction {cid} in {label}"


# --- 2. 4-bit rows: a compacted baseline restores what its chain restores -----------------------


def test_adaptive4_compaction_is_identical_to_its_chain(tmp_path, unique_name, debug_config: DebugConfig, run_cli: CliRunner):
    job = _job(unique_name("q4"), encoding="adaptive4")
    run_dir = tmp_path / "run"
    cfg = _ckpt_config(debug_config, job, run_dir)
    last = _train_40_steps_followed(debug_config, job, tmp_path, cfg)
    catalog = _catalog(cfg)
    assert catalog.commits[last].encodings.get("weights") == "adaptive4", catalog.commits[last].encodings
    log = (tmp_path / "follower.log").read_text()
    assert len(catalog.compactions) >= 2, f"compactions {sorted(catalog.compactions)}\n{log[-2500:]}"
    assert "compacted into" in log

    cli = ("trainer.ckpt_cli", "--config", debug_config.path, f"run.dir={run_dir}", *job)
    newest_compacted = max(catalog.compactions)
    verify = run_cli(*cli, "verify", "--checkpoint", str(newest_compacted))
    assert f"checkpoint {newest_compacted} " in verify.stdout and "OK" in verify.stdout, verify.stdout
    assert f"compacted baseline of checkpoint {newest_compacted}: identical to its chain" in verify.stdout, (
        verify.stdout + verify.stderr[-2000:]
    )

    # In-process: every compacted baseline, and the newest checkpoint's cheapest chain, give
    # exactly the tables the trainer's own links give (decoded 4-bit rows included).
    for cid, compacted in sorted(catalog.compactions.items()):
        original = _original_chain(catalog, catalog.commits[cid].chain)
        assert original[0].full and not is_compacted(original[0].generation) and len(original) == cid
        want = _tables(catalog.commits[cid], original, cfg)
        _assert_same_tables(
            _tables(catalog.commits[cid], compacted.chain, cfg),
            want,
            f"compacted baseline of checkpoint {cid} vs chain {[x.checkpoint_id for x in original]}",
        )
        assert compacted.chain[0].bytes < sum(x.bytes for x in original)
    newest = catalog.commits[last]
    cheapest = catalog.cheapest(newest)
    assert is_compacted(cheapest.chain[0].generation), [x.checkpoint_id for x in cheapest.chain]
    _assert_same_tables(
        _tables(newest, cheapest.chain, cfg),
        _tables(newest, _original_chain(catalog, newest.chain), cfg),
        f"checkpoint {last}: chain {[x.checkpoint_id for x in cheapest.chain]} vs the trainer's",
    )
    # the 4-bit rows really are quantized: weights differ from the trained fp32 ones
    dumps = _dumps(run_dir)
    tables = _tables(newest, cheapest.chain, cfg)
    dumped = {k: v for d in dumps for k, v in d.items() if k.startswith(f"emb/{table_key('t_user')}/") and k.endswith("/weight")}
    ((name, value),) = dumped.items()  # table_wise: one shard of t_user
    assert not torch.equal(tables[table_key("t_user")]["weight"], value), "adaptive4 rows came back as fp32"
    assert torch.allclose(tables[table_key("t_user")]["weight"], value, atol=0.1), name


# --- 3. serving snapshots ------------------------------------------------------------------------


def _fresh_train_model(debug_config: DebugConfig, job: list[str]) -> torch.nn.Module:
    """An unsharded DLRMTrain with its (meta) tables given memory (see tests/multirank/test_export_fqn.py)."""
    model = build_model(debug_config.load(job, check_data=False).model, torch.device("cpu"))
    model.get_submodule(EBC_PATH).to_empty(device="cpu")
    return model


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.load in this one process
def test_serving_snapshots_load_into_a_fresh_dlrm(tmp_path, unique_name, debug_config: DebugConfig, run_cli: CliRunner):
    job = [*_job(unique_name("serve")), "ckpt.follow.export_keep=2"]
    run_dir = tmp_path / "run"
    cfg = _ckpt_config(debug_config, job, run_dir)
    # every other application exported, at least 3 of them: the follower must apply most of the
    # 8 checkpoints one by one (applied at once in a chain they are one application)
    _train_40_steps_followed(debug_config, job, tmp_path, cfg, "--export-every", "2", pace_s=1.0)

    records = read_jsonl(run_dir / "follower.jsonl")
    exports = [r for r in records if "export_ckpt" in r]
    applied = [r for r in records if "follow_ckpt" in r]
    assert len(exports) == len(applied) // 2 >= 3, (exports, [r["follow_ckpt"] for r in applied])
    serving = run_dir / "serving"
    files = sorted(p.name for p in serving.glob("model-*.pt"))
    dirs = sorted(p.name for p in serving.glob("model-*.dcp"))
    kept = [Path(r["export_path"]).name for r in exports[-2:]]
    assert files == kept, (files, exports)  # export_keep=2: the newest two, older ones removed
    assert dirs == [name[: -len(".pt")] + ".dcp" for name in kept], dirs
    assert not [p for p in serving.iterdir() if p.name.startswith(".")], "temporary files left behind"
    follower_log = (tmp_path / "follower.log").read_text()
    assert "Warning" not in follower_log, follower_log  # dcp.save's single-process note is filtered

    newest = serving / kept[-1]
    snap = torch.load(newest)
    cid = exports[-1]["export_ckpt"]
    catalog = _catalog(cfg)
    marker = catalog.commits[cid]
    assert snap["fqn_root"] == "DLRM" and snap["checkpoint_id"] == cid and snap["step"] == marker.step
    assert newest.name == f"model-{cid:08d}-step-{marker.step}.pt"

    # The snapshot into a freshly built DLRM, strictly.
    served = _fresh_train_model(debug_config, job).model
    assert set(snap["model"]) == set(served.state_dict())
    served.load_state_dict(snap["model"])
    # Its DCP directory into another fresh DLRM's own state_dict.
    from_dcp = _fresh_train_model(debug_config, job).model
    target = from_dcp.state_dict()
    dcp.load(target, checkpoint_id=str(newest.with_suffix(".dcp")))
    for fqn, value in snap["model"].items():
        assert torch.equal(target[fqn], value), f"{fqn}: DCP and torch.save snapshots differ"
        assert torch.equal(from_dcp.state_dict()[fqn], value), f"{fqn}: dcp.load did not fill the model"

    # The trainer-side export of the same checkpoint (deltarec-ckpt export) holds the same model.
    out = tmp_path / "export.pt"
    p = run_cli("trainer.ckpt_cli", "--config", debug_config.path, f"run.dir={run_dir}", *job,
                "export", "--out", out, "--checkpoint", str(cid))  # fmt: skip
    assert f"exported checkpoint {cid} " in p.stdout, p.stdout
    exported = torch.load(out)
    assert set(exported["model"]) == {f"model.{k}" for k in snap["model"]}
    for fqn, value in snap["model"].items():
        assert torch.equal(exported["model"][f"model.{fqn}"], value), f"{fqn}: snapshot differs from the export"
    assert set(exported["optim"]) == {f"model.{k}" for k in snap["optim"]}
    for fqn, states in snap["optim"].items():
        for state, value in states.items():
            assert torch.equal(exported["optim"][f"model.{fqn}"][state], value), f"optim {fqn} {state}"
    # ... independently of any compaction: the tables replayed from the trainer's own links
    tables = _tables(marker, _original_chain(catalog, marker.chain), cfg)
    for table, tensors in tables.items():
        assert torch.equal(snap["model"][snap["tables"][table]], tensors["weight"]), f"{table}: not the trainer's rows"
    reference = _fresh_train_model(debug_config, job)
    reference.load_state_dict(exported["model"])

    # Predictions on a batch: the served DLRM, its DCP twin and the exported DLRMTrain agree.
    jcfg = debug_config.load(job, check_data=False)
    batch = make_reader(jcfg, DistEnv(0, 1, 0, 1, "single"), "eval").next_batch()
    with torch.no_grad():
        logits = {}
        for name, model in (("served", served), ("dcp", from_dcp), ("export", reference.model)):
            model.eval()
            logits[name] = model(batch.dense_features, batch.sparse_features)
    assert logits["export"].shape == (jcfg.data.batch_size, 1) and logits["export"].std() > 0
    assert torch.equal(logits["served"], logits["export"])
    assert torch.equal(logits["dcp"], logits["export"])


# --- 4. two followers: one compacts, the other takes over ----------------------------------------


@pytest.mark.parametrize("sink", ["filesystem", "kafka"])
def test_gc_beside_an_every_step_job_and_its_follower_leaves_the_newest_checkpoint_restorable(
    tmp_path, broker, unique_name, sink, debug_config: DebugConfig, capsys
):
    """The every-step setup docs/checkpoints.md recommends, all at once: 2 ranks checkpoint
    every step, a follower compacts their chain, and `deltarec-ckpt gc --keep 2` runs again and
    again. gc never drops what the newest checkpoint's cheapest chain reads (the follower's
    newest baselines included), no checkpoint fails, and the run resumes from the newest."""
    job = [*_job(unique_name("gc-follow"), sink, broker.bootstrap if sink == "kafka" else ""), "ckpt.schedule.interval_steps=1"]
    cfg = _ckpt_config(debug_config, job, tmp_path / "run")
    follower = FollowerProc(debug_config.path, job, tmp_path, "follower")
    tool = ["--config", str(debug_config.path), f"run.dir={tmp_path / 'run'}", *job]
    group = start_ranks(debug_config.path, [*job, "train.steps=300"], tmp_path, timeout_s=240)
    rounds = 0
    try:
        while group.running():
            rc = ckpt_cli.main([*tool, "gc", "--keep", "2"], load_job_ckpt_config)
            assert rc == 0, capsys.readouterr()
            rounds += 1
            time.sleep(0.2)  # gc every little while, as a cron job would
    finally:
        group.wait()
    assert ckpt_cli.main([*tool, "gc", "--keep", "2"], load_job_ckpt_config) == 0
    capsys.readouterr()
    catalog = _catalog(cfg)
    newest = max(catalog.commits)
    assert rounds >= 3 and catalog.compactions, (rounds, sorted(catalog.compactions))
    assert not catalog.failed, f"checkpoints failed beside gc: {sorted(catalog.failed)}"
    restorable = catalog.restorable()
    assert restorable and restorable[0].checkpoint_id == newest, [m.checkpoint_id for m in restorable[:3]]
    assert not {link.generation for link in restorable[0].chain} & catalog.dropped
    assert follower.stop() == 0, follower.tail()
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=310"], tmp_path)
    assert f"deltarec: resumed from checkpoint {newest} at step 300" in resumed[0].stdout, resumed[0].stdout[-2000:]


def test_a_follower_beside_an_every_step_job_with_keep_dense_applies_every_checkpoint_and_goes_on_exporting(
    tmp_path, unique_name, debug_config: DebugConfig
):
    """`ckpt.write.keep_dense=2` beside a follower exporting a serving snapshot every 5 applications:
    the trainer deletes dense files while the follower applies and exports. The follower applies
    the last checkpoint and keeps exporting: an export may only fail for a dense file deleted under
    it (one warning; the next application is exported), and its newest serving snapshot loads."""
    job = [*_job(unique_name("keep-dense")), "ckpt.schedule.interval_steps=1", "ckpt.write.keep_dense=2"]
    run_dir = tmp_path / "run"
    cfg = _ckpt_config(debug_config, job, run_dir)
    follower = FollowerProc(debug_config.path, job, tmp_path, "follower", "--export-every", "5")
    try:
        _wait_for(lambda: "following run" in follower.text(), 60, "the follower to start", (follower,))
        spawn_ranks(debug_config.path, [*job, "train.steps=150"], tmp_path, timeout_s=240)
        last = max(_catalog(cfg).commits)
        _wait_for(lambda: f"checkpoint {last} (step 150) applied" in follower.text(), 60, f"checkpoint {last}", (follower,))
        assert follower.stop() == 0, follower.tail()
    finally:
        follower.kill()
    assert len(list((run_dir / "dense").glob("dense-*.pt"))) == 2
    failed = [line for line in follower.text().splitlines() if "serving snapshot of checkpoint" in line and "failed" in line]
    assert all("is missing" in line for line in failed), failed  # a deleted dense file, and nothing else
    exports = [r for r in read_jsonl(run_dir / "follower.jsonl") if "export_ckpt" in r]
    assert exports, failed[:3]  # how many depends on how many checkpoints each pass applies
    newest = torch.load(exports[-1]["export_path"], weights_only=True)
    assert newest["checkpoint_id"] == exports[-1]["export_ckpt"], sorted(newest)


def test_two_followers_one_compacts_the_other_takes_over(tmp_path, unique_name, debug_config: DebugConfig):
    job = _job(unique_name("two"))
    run_dir = tmp_path / "run"
    cfg = _ckpt_config(debug_config, job, run_dir)
    a = b = None
    try:
        a = FollowerProc(debug_config.path, job, tmp_path, "follower-a")
        b = FollowerProc(debug_config.path, job, tmp_path, "follower-b")
        _wait_for(lambda: "following run" in a.text() and "following run" in b.text(), 60, "both followers to start", (a, b))
        spawn_ranks(debug_config.path, [*job, "train.steps=30"], tmp_path, timeout_s=180)
        last = max(_catalog(cfg).commits)
        _wait_for(
            lambda: all(f"checkpoint {last} (step 30) applied" in f.text() for f in (a, b)),
            60,
            f"both followers applying checkpoint {last}",
            (a, b),
        )
        first = _catalog(cfg)
        assert first.compactions, f"no compaction\n{a.tail()}\n{b.tail()}"
        writers = {m.follower for m in first.compactions.values()}
        assert len(writers) == 1, f"compactions by {writers}"
        holder, standby = (a, b) if _owner_pid(writers.pop()) == a.pid else (b, a)
        assert first.lease is not None and _owner_pid(first.lease.holder) == holder.pid
        assert "compacted into" in holder.text() and "holding the compaction lease (epoch 1)" in holder.text()
        standing_by = standby.text()
        assert "compacted into" not in standing_by and "holding the compaction lease" not in standing_by, standby.tail()
        assert not first.fenced

        assert holder.stop() == 0, holder.tail()
        assert "stopped:" in holder.text()
        # the release lets the standby claim on its next poll (not lease_s later), and compact what comes next
        _wait_for(lambda: "holding the compaction lease (epoch 2)" in standby.text(), 20, "the standby taking over", (standby,))
        spawn_ranks(debug_config.path, [*job, "train.steps=60", "ckpt.restore.resume=latest"], tmp_path, timeout_s=180)
        final_id = max(_catalog(cfg).commits)
        _wait_for(
            lambda: f"checkpoint {final_id} (step 60) applied" in standby.text(),
            60,
            f"the standby applying checkpoint {final_id}",
            (standby,),
        )
        assert standby.stop() == 0, standby.tail()
    finally:
        for f in (a, b):
            if f is not None:
                f.kill()

    catalog = _catalog(cfg)
    accepted, leases = _lease_history(cfg)
    assert [(e, _owner_pid(h)) for e, h, _ in accepted] == [(1, holder.pid), (2, standby.pid)], accepted
    claims = [_owner_pid(r.follower) for r in leases if r.event == "claim"]
    assert holder.pid in claims and standby.pid in claims
    released = [r for r in leases if r.event == "release"]
    assert [_owner_pid(r.follower) for r in released] == [holder.pid, standby.pid], released
    renewed = max(r.created_unix for r in leases if _owner_pid(r.follower) == holder.pid and r.event != "release")
    assert accepted[1][2] - renewed < LEASE_S, "the standby waited for the lease to expire instead of the release"
    assert not catalog.fenced
    by = {cid: _owner_pid(m.follower) for cid, m in sorted(catalog.compactions.items())}
    old = [cid for cid, pid in by.items() if pid == holder.pid]
    new = [cid for cid, pid in by.items() if pid == standby.pid]
    assert set(by.values()) <= {holder.pid, standby.pid}, by
    # the standby may compact the newest checkpoint of the first run as soon as it holds the
    # lease (its chain was due), never one the holder compacted or one before it
    assert old and new and max(old) <= last <= min(new) and max(old) < min(new), f"compactions by follower: {by}"
    assert all(generation_label(catalog.compactions[c].chain[0].generation).startswith("e2.") for c in new), by
    assert "compacted into" in standby.text()
    newest = catalog.restorable()[0]
    assert newest.checkpoint_id == final_id and is_compacted(newest.chain[0].generation)


# --- 5. a lease that frees up later -------------------------------------------------------------


def test_a_follower_that_gets_the_lease_late_compacts_without_a_new_commit(tmp_path, unique_name, debug_config: DebugConfig):
    """A killed follower's lease stays valid for lease_s; its successor follows at once and
    compacts the chain that is due as soon as the lease is free, with no new COMMIT."""
    job = _job(unique_name("late"))
    run_dir = tmp_path / "run"
    spawn_ranks(debug_config.path, [*job, "train.steps=40"], tmp_path, timeout_s=180)  # 8 checkpoints
    cfg = _ckpt_config(debug_config, job, run_dir)
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:  # a follower that claimed the lease and died: nobody releases it
        backend.markers.append_marker(
            encode_marker(
                LeaseRecord(
                    kind="lease", run_id=cfg.run_id, follower="gone:1:x", event="claim", lease_s=LEASE_S, created_unix=time.time()
                )
            )
        )
    finally:
        backend.close()
    follower = FollowerProc(debug_config.path, job, tmp_path, "late")
    try:
        _wait_for(lambda: "compacted into e2.c8" in follower.text(), 60, "the compaction of checkpoint 8", (follower,))
        catalog = _catalog(cfg)
        assert sorted(catalog.compactions) == [8] and catalog.lease.epoch == 2, follower.tail()
        assert [link.checkpoint_id for link in catalog.cheapest(catalog.commits[8]).chain] == [8]
        assert follower.stop() == 0
    finally:
        follower.kill()


# --- 6. checkpoints found waiting: one pass, the same rows ----------------------------------------


@pytest.mark.parametrize("sink", ["filesystem", "kafka"])
def test_a_paused_follower_applies_the_waiting_checkpoints_in_one_pass_and_compacts_what_its_chain_restores(
    tmp_path, request, sink, unique_name, debug_config: DebugConfig
):
    """The follower is paused (SIGSTOP) once it holds a checkpoint, while the job commits the
    rest; continued, it applies them in one pass and compacts the newest. That baseline holds
    exactly the tables the trainer's own chain of it restores (fp32 rows: bit for bit)."""
    bootstrap = request.getfixturevalue("broker").bootstrap if sink == "kafka" else ""
    job = [*_job(unique_name("pass"), sink, bootstrap), "ckpt.follow.compact_links=2"]
    run_dir = tmp_path / "run"
    cfg = _ckpt_config(debug_config, job, run_dir)
    follower = FollowerProc(debug_config.path, job, tmp_path, "follower")
    group = None
    try:
        _wait_for(lambda: "following run" in follower.text(), 60, "the follower to start", (follower,))
        # each checkpoint's copy starts a second late (DELTAREC_SLOW_COPY): the follower holds one
        # long before the job ends, even on a busy machine
        pace = {"DELTAREC_SLOW_COPY": "*:1.0"}
        group = start_ranks(debug_config.path, [*job, "train.steps=40"], tmp_path, timeout_s=180, env_extra=pace)
        _wait_for(lambda: ") applied (" in follower.text(), 120, "a checkpoint applied", (follower,), group)
        follower.proc.send_signal(signal.SIGSTOP)
        try:
            group.wait()
        finally:
            follower.proc.send_signal(signal.SIGCONT)
        last = max(_catalog(cfg).commits)
        _wait_for(lambda: f"checkpoint {last} compacted into" in follower.text(), 60, f"checkpoint {last} compacted", (follower,))
        assert follower.stop() == 0, follower.tail()
    finally:
        follower.kill()
        if group is not None and group.running():
            for p in group.procs:
                if p.poll() is None:
                    p.kill()
            group.wait(expect_ok=False)

    applied = [r for r in _follower_records(run_dir) if "follow_ckpt" in r]
    assert applied[-1]["follow_ckpt"] == last and not applied[-1]["follow_rebuilt"], applied
    held_before = applied[-2]["follow_ckpt"]
    assert last - held_before >= 2, f"no pass of several checkpoints: {[r['follow_ckpt'] for r in applied]}"
    assert f"checkpoint {last} (step 40) applied ({last - held_before} deltas from checkpoint {held_before + 1} on)" in (
        follower.text()
    )
    catalog = _catalog(cfg)
    compacted = catalog.compactions[last]
    original = _original_chain(catalog, list(catalog.commits[last].chain))
    assert original[0].full and not is_compacted(original[0].generation) and len(original) == last
    _assert_same_tables(
        _tables(catalog.commits[last], list(compacted.chain), cfg),
        _tables(catalog.commits[last], original, cfg),
        f"compacted baseline of checkpoint {last} vs chain {[x.checkpoint_id for x in original]}",
    )
