"""Rewinds and abandoned branches (ckpt/log/catalog.py, "Branches"): a trainer attempt's ATTEMPT
record names the checkpoint it resumed from, and every reader of the log then leaves the
checkpoints after it out: `restorable()` and `ckpt.restore.resume=latest`, the catalog records a restore
reads from, the follower and the server, and `deltarec-ckpt list` marks them. Logs whose
records do not say (older versions) fold as they always did."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckpt.cli import cmd_list
from ckpt.dense.store import DenseHistory
from ckpt.follow.follower import CommitIds, Follower, FollowStats, Rewind
from ckpt.log.catalog import Catalog
from ckpt.log.catalog_record import from_record, read_recent_catalog, summarize
from ckpt.log.links import append_with_link
from ckpt.log.markers import AttemptRecord, ChainLink, Marker, decode_record, encode_marker
from ckpt.restore.choice import ResumeChoice
from ckpt.types import RestoreError
from tests.unit.test_catalog_record import MemoryLog, RunSim, _assert_answers_like
from tests.unit.test_serve_versions import FakeDense, Trainer, _apply, _assert_live, _cfg
from trainer.serve.versions import NotReady, ServedModel

RUN = "cr"  # the run of test_catalog_record's simulation


def _link(cid: int, generation: int = 1, full: bool = False) -> ChainLink:
    return ChainLink(checkpoint_id=cid, full=full, generation=generation, ranges={0: [(cid, cid)]}, rows=1, bytes=100)


def _attempt(name: str, resumed_from: int = -1) -> AttemptRecord:
    return AttemptRecord(
        kind="attempt", run_id=RUN, role="trainer", attempt=name, world_size=1, created_unix=10.0, resumed_from=resumed_from
    )


class Run:
    """A run written as the trainer writes it (markers by reference), folded as it grows."""

    def __init__(self, tmp: Path | None = None) -> None:
        self.log = MemoryLog()
        self.fold = Catalog(RUN)
        self.tmp = tmp
        self.links: dict[int, ChainLink] = {}

    def append(self, record: AttemptRecord | Marker) -> None:
        n = len(self.log.records)
        if isinstance(record, Marker):
            append_with_link(self.log, record, record.attempt)
        else:
            self.log.append_marker(encode_marker(record))
        self.fold.feed(self.log.records[n:])

    def commit(self, cid: int, after: list[int], attempt: str) -> None:
        """Checkpoint `cid`, a delta on the chain of the checkpoints `after` (none: full)."""
        own = _link(cid, generation=after[0] if after else cid, full=not after)
        self.links[cid] = own
        dense = {"path": str(self.tmp / f"{cid}.pt") if self.tmp else ""}
        if self.tmp:
            Path(dense["path"]).write_bytes(b"x")
        chain = [self.links[c] for c in after] + [own]
        marker = Marker(
            kind="commit", run_id=RUN, checkpoint_id=cid, step=10 * cid, world_size=1, chain=chain, attempt=attempt, dense=dense
        )
        self.append(marker)


def _ids(markers: list[Marker]) -> list[int]:
    return [m.checkpoint_id for m in markers]


def _rewound(tmp: Path | None = None) -> Run:
    """Attempt a1 (an older version: its record says nothing) commits 1..6; a2 resumes from 3
    and commits 7 and 8 on the chain through 3."""
    run = Run(tmp)
    run.append(_attempt("a1"))
    for cid in range(1, 7):
        run.commit(cid, list(range(1, cid)), "a1")
    run.append(_attempt("a2", resumed_from=3))
    return run


def _choice(resume: str, on_corrupt: str = "fail") -> ResumeChoice:
    """`ResumeChoice` for its `_choose` alone (what `ckpt.restore.resume` picks from a fold)."""
    choice = ResumeChoice.__new__(ResumeChoice)
    choice.cfg = SimpleNamespace(resume=resume, on_corrupt=on_corrupt)  # type: ignore[assignment]
    choice.run_id = RUN
    choice.backend = SimpleNamespace(where="memory")  # type: ignore[assignment]
    choice.dense = SimpleNamespace(root="run/dense")  # type: ignore[assignment]
    return choice


NO_HISTORY = DenseHistory(0, [])


def test_a_rewind_abandons_the_checkpoints_after_the_one_resumed_and_latest_leaves_them_out() -> None:
    run = _rewound()
    c = run.fold
    assert [cid for cid in c.commits if c.abandoned(cid)] == [4, 5, 6]
    assert _ids(c.restorable()) == [3, 2, 1]  # before the new branch commits: `latest` is 3, not 6
    assert _ids(c.restorable(abandoned=True)) == [6, 5, 4, 3, 2, 1]
    assert _ids(_choice("latest")._choose(c, NO_HISTORY))[:1] == [3]
    by = c.abandoned_by(5)
    assert by is not None and (by.attempt, by.resumed_from, by.newest) == ("a2", 3, 6)
    run.commit(7, [1, 2, 3], "a2")
    run.commit(8, [1, 2, 3, 7], "a2")
    assert _ids(c.restorable()) == [8, 7, 3, 2, 1]
    assert [link.checkpoint_id for link in c.commits[8].chain] == [1, 2, 3, 7, 8]  # by reference, resolved
    assert _ids(_choice("latest")._choose(c, NO_HISTORY)) == [8, 7, 3, 2, 1]  # fallbacks stay on the live branch


def test_restoring_an_abandoned_checkpoint_by_id_makes_its_branch_live_again_up_to_it() -> None:
    run = _rewound()
    run.commit(7, [1, 2, 3], "a2")
    run.commit(8, [1, 2, 3, 7], "a2")
    c = run.fold
    chosen = _choice("5")._choose(c, NO_HISTORY)
    assert _ids(chosen) == [5, 4, 3, 2, 1]  # falls back along 5's own history, never to 7 or 8
    assert _ids(_choice("8")._choose(c, NO_HISTORY)) == [8, 7, 3, 2, 1]  # and 8's never to 4-6
    run.append(_attempt("a3", resumed_from=5))
    assert [cid for cid in c.commits if c.abandoned(cid)] == [6, 7, 8]
    run.commit(9, [1, 2, 3, 4, 5], "a3")
    assert _ids(c.restorable()) == [9, 5, 4, 3, 2, 1]
    assert c.live == ((1, 5), (9, c.live[-1][1]))
    by = c.abandoned_by(7)
    assert by is not None and by.attempt == "a3"


def test_an_explicit_id_that_no_chain_restores_is_still_refused() -> None:
    run = _rewound()
    with pytest.raises(RestoreError, match="checkpoint 42 of run cr has no COMMIT marker"):
        _choice("42")._choose(run.fold, NO_HISTORY)


def test_a_fresh_start_abandons_everything_before_it_and_latest_then_starts_fresh_too() -> None:
    run = _rewound()
    run.append(_attempt("a3", resumed_from=0))
    c = run.fold
    assert c.restorable() == [] and all(c.abandoned(cid) for cid in c.commits)
    history = DenseHistory(6, [SimpleNamespace(checkpoint_id=6)])  # type: ignore[list-item]
    assert _choice("latest")._choose(c, history) == []  # not the lost-stream refusal: the log has them, abandoned
    run.commit(7, [], "a3")
    assert _ids(c.restorable()) == [7]


def test_ordinary_restarts_abandon_nothing_and_keep_one_run_of_live_ids() -> None:
    run = Run()
    run.append(_attempt("a1", resumed_from=0))
    chain: list[int] = []
    for n, cid in enumerate(range(1, 40)):
        run.commit(cid, chain, f"a{n // 5 + 1}")
        chain.append(cid)
        if cid % 5 == 0:  # a restart that resumes the newest (`latest`)
            run.append(_attempt(f"a{n // 5 + 2}", resumed_from=cid))
    c = run.fold
    assert not any(c.abandoned(cid) for cid in c.commits) and len(c.live) == 1
    assert _ids(c.restorable()) == list(range(39, 0, -1))


def test_logs_without_the_field_fold_as_before() -> None:
    """Records of older versions (no `resumed_from`) read back as -1 and change nothing: a
    restart from an older checkpoint in such a log is not known as one."""
    old = _attempt("a1")
    wire = encode_marker(old)
    assert "resumed_from" not in json.loads(wire[8:])
    assert decode_record(wire) == old and old.resumed_from == -1
    run = Run()
    run.append(_attempt("a1"))
    for cid in range(1, 5):
        run.commit(cid, list(range(1, cid)), "a1")
    run.append(_attempt("a2"))  # resumed from 2, say, but an older version does not record it
    run.commit(5, [1, 2], "a2")
    c = run.fold
    assert c.branches == [] and not any(c.abandoned(cid) for cid in c.commits)
    assert _ids(c.restorable()) == [5, 4, 3, 2, 1]
    new = _attempt("a3", resumed_from=7)
    assert decode_record(encode_marker(new)).resumed_from == 7


def test_a_catalog_record_carries_the_branches_and_its_fold_answers_as_the_whole_log() -> None:
    run = _rewound()
    run.commit(7, [1, 2, 3], "a2")
    record = summarize(run.fold, keep=2)
    assert record.branches == [[6, 3, "a2"]]
    assert [m.checkpoint_id for m in record.commits] == [3, 7]  # the abandoned ones are not kept
    back = decode_record(encode_marker(record))
    folded = from_record(back, run.log.read_markers)  # type: ignore[arg-type]
    assert folded.live == run.fold.live and all(folded.abandoned(cid) for cid in (4, 5, 6))
    assert _ids(folded.restorable()) == [7, 3]
    # a later explicit resume of an abandoned checkpoint: a fold from the record reads the whole log
    run.log.append_marker(encode_marker(record))
    run.append(_attempt("a3", resumed_from=5))
    assert _ids(read_recent_catalog(run.log, RUN).restorable()) == [5, 4, 3, 2, 1]  # before it commits, too
    run.commit(8, [1, 2, 3, 4, 5], "a3")
    recent = read_recent_catalog(run.log, RUN)
    assert _ids(recent.restorable()) == [8, 5, 4, 3, 2, 1] == _ids(run.fold.restorable())


class RewindSim(RunSim):
    """test_catalog_record's random run whose restarts say what they resumed from: the newest
    restorable checkpoint mostly, an older one (or an abandoned one, by its id) now and then,
    or a fresh start; the record is appended after the choice, as the trainer does."""

    def restart(self) -> None:
        if self.rng.random() < 0.3:
            self.zombie = self.attempt
        live, every = self.fold.restorable(), self.fold.restorable(abandoned=True)
        r = self.rng.random()
        pick = (live[:1] if r < 0.6 else [self.rng.choice(live)] if r < 0.8 else [self.rng.choice(every)]) if live else []
        if every and self.rng.random() < 0.05:
            pick = []
        self.attempt = f"a{self.next_id}x{self.rng.randrange(1000)}"
        self.announce(pick[0].checkpoint_id if pick else 0)
        self.chain = list(pick[0].chain) if pick else []


@pytest.mark.parametrize("by_reference", [False, True], ids=["inline", "by-reference"])
def test_random_runs_with_rewinds_fold_from_a_catalog_record_as_from_the_whole_log(replay_seed, by_reference: bool) -> None:
    rng = replay_seed.rng()
    rewound = 0
    for run in range(12):
        sim = RewindSim(rng, every=rng.randint(1, 6), by_reference=by_reference)
        for _ in range(rng.randint(40, 160)):
            sim.step()
        for n in sorted(rng.sample(range(1, len(sim.log.records) + 1), min(6, len(sim.log.records)))):
            why = f"run {run}, first {n} records, {replay_seed}"
            log = sim.log.prefix(n)
            whole = Catalog(RUN).feed(log.records)
            recent = read_recent_catalog(log, RUN)
            _assert_answers_like(recent, whole, why)
            assert recent.live == whole.live and recent.branches == whole.branches, why
            rewound += any(whole.abandoned(cid) for cid in whole.commits)
        # every commit of the newest attempt is live, and the newest restorable one is its newest
        newest = [cid for cid, m in sim.fold.commits.items() if m.attempt == sim.attempt]
        assert not any(sim.fold.abandoned(cid) for cid in newest), replay_seed
    assert rewound, f"no run rewound: the simulation lost its point ({replay_seed})"


def test_deltarec_ckpt_list_marks_the_abandoned_checkpoints(tmp_path: Path, capsys) -> None:
    run = _rewound(tmp_path)
    run.commit(7, [1, 2, 3], "a2")
    (tmp_path / "6.pt").unlink()  # gc took its dense file
    assert cmd_list(run.fold) == 0
    lines = {int(line.split()[0]): line for line in capsys.readouterr().out.splitlines() if line.split()[0].isdigit()}
    for cid in (1, 2, 3, 7):
        assert lines[cid].endswith("complete"), lines[cid]
    for cid in (4, 5):
        assert lines[cid].endswith("abandoned: attempt a2 resumed from checkpoint 3"), lines[cid]
    assert lines[6].endswith("abandoned: attempt a2 resumed from checkpoint 3, dense file deleted (gc or ckpt.write.keep_dense)")


# --- the follower and the server's model after a rewind ------------------------------------------


def _follower(catalog: Catalog, applied: int) -> tuple[Follower, list[Rewind]]:
    """A follower holding checkpoint `applied`, and the rewinds it reports (`on_rewind`)."""
    f = Follower.__new__(Follower)  # no backend: only the rewind's bookkeeping is exercised
    rewinds: list[Rewind] = []
    f.catalog, f.store, f.stats, f.on_rewind = catalog, None, FollowStats(), rewinds.append
    f.applied, f.chain, f._ids = catalog.commits[applied], list(catalog.commits[applied].chain), CommitIds()
    return f, rewinds


def test_the_follower_drops_an_abandoned_checkpoint_and_rebuilds_the_newest_live_one() -> None:
    run = Run()
    run.append(_attempt("a1", resumed_from=0))
    for cid in range(1, 7):
        run.commit(cid, list(range(1, cid)), "a1")
    f, rewinds = _follower(run.fold, 6)
    assert not f._check_rewind() and f._pending() == []
    run.append(_attempt("a2", resumed_from=3))
    assert f._check_rewind()
    (rewind,) = rewinds
    assert (rewind.abandoned, rewind.resumed_from, rewind.newest, rewind.attempt) == (6, 3, 6, "a2")
    assert rewind.announced_unix == 10.0 and "checkpoint 6 was abandoned: trainer attempt a2 resumed from checkpoint 3" in (
        rewind.describe()
    )
    assert f.applied is None and f.stats.rewinds == 1
    assert _ids(f._pending()) == [3]  # the checkpoint resumed from, until the new branch commits
    run.commit(7, [1, 2, 3], "a2")
    assert _ids(f._pending()) == [7]
    f.applied = run.fold.commits[3]
    assert _ids(f._pending()) == [7]  # after 3, the new branch only: never 4-6


def test_a_follower_behind_the_rewind_point_goes_on_by_deltas() -> None:
    run = _rewound()
    f, rewinds = _follower(run.fold, 2)
    assert not f._check_rewind() and not rewinds and _ids(f._pending()) == [3]


def test_the_served_model_withdraws_an_abandoned_checkpoint_at_once_and_serves_the_live_branch() -> None:
    cfg = _cfg()
    dense = FakeDense(cfg)
    model = ServedModel(cfg, dense)  # type: ignore[arg-type]
    trainer = Trainer(seed=7)
    _apply(model, dense, 1, trainer.full(1), rebuild=True)
    at3 = None
    for cid in range(2, 7):
        if cid == 4:
            at3 = Trainer(seed=0)
            at3.tables = {t: w.clone() for t, w in trainer.tables.items()}
        _apply(model, dense, cid, trainer.delta(cid), rebuild=False)
    assert at3 is not None
    held = model.acquire()
    version = held.__enter__()  # a request computing on 6 when the rewind comes
    rewind = Rewind(abandoned=6, resumed_from=3, newest=6, attempt="a2", announced_unix=1.0, seen_unix=2.0)
    model.withdraw(rewind)
    with pytest.raises(NotReady, match="rebuilding after a rewind: checkpoint 6 was abandoned"), model.acquire():
        pass
    assert version.checkpoint_id == 6  # the request in flight keeps its copy
    held.__exit__(None, None, None)
    # the follower rebuilds 3 (its rows as 3 had them), then the new branch's deltas
    _apply(model, dense, 3, at3.full(3), rebuild=True)
    _assert_live(model, at3, 3)
    with model.acquire() as v:
        assert v.rewind is not None and v.rewind.resumed(3) and not v.at_start
    _apply(model, dense, 7, at3.delta(7), rebuild=False)
    _assert_live(model, at3, 7)
    with model.acquire() as v:
        assert v.rewind is not None and not v.rewind.resumed(7)  # the new branch: its freshness counts
    _apply(model, dense, 8, at3.delta(8), rebuild=False)  # into the withdrawn copy, which copies every row first
    _assert_live(model, at3, 8)
    with model.acquire() as v:
        assert v.rewind is None
    assert len(model.rewinds) == 1


def test_serving_snapshots_of_an_abandoned_branch_are_removed(tmp_path: Path) -> None:
    from ckpt.follow.serving import Publisher, list_snapshots, snapshot_paths

    for cid in (3, 5, 6):
        path, dcp = snapshot_paths(tmp_path, cid, 10 * cid)
        path.write_bytes(b"x")
        dcp.mkdir()
    publisher = Publisher(tmp_path, None, keep=3, dcp=True)  # type: ignore[arg-type]
    assert publisher.withdraw(lambda cid: cid > 3) == [5, 6]
    assert [cid for cid, _ in list_snapshots(tmp_path)] == [3] and len(list(tmp_path.iterdir())) == 2


def test_random_histories_never_leave_the_newest_attempts_commits_abandoned() -> None:
    rng = random.Random(5)
    for _ in range(50):
        run = Run()
        run.append(_attempt("a0", resumed_from=0))
        attempt, chains, cid = "a0", {}, 0
        chain: list[int] = []
        for n in range(rng.randint(5, 40)):
            if rng.random() < 0.2 and run.fold.restorable(abandoned=True):
                pick = rng.choice(run.fold.restorable(abandoned=True))
                attempt = f"a{n + 1}"
                run.append(_attempt(attempt, resumed_from=pick.checkpoint_id))
                chain = chains[pick.checkpoint_id]
            cid += 1
            run.commit(cid, chain, attempt)
            chains[cid] = chain = [*chain, cid]
        c = run.fold
        # a checkpoint is live exactly when it is on the newest live chain's history
        newest = c.restorable()[0]
        on_chain = {link.checkpoint_id for link in newest.chain}
        for k in c.commits:
            if k <= newest.checkpoint_id:
                assert c.abandoned(k) == (k not in on_chain), (k, sorted(on_chain))
