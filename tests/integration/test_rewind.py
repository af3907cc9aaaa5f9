"""Rewinds against a real job and a real server: the trainer resumes from an older checkpoint
while `deltarec-serve` answers requests, and the server stops answering from the branch the
rewind abandoned within a bound (docs/serving.md, "Rewinds"), serves the live branch, bit for
bit its export; `deltarec-ckpt list` marks the abandoned checkpoints; and `ckpt.restore.resume=latest`
after a rewind that died before its first checkpoint resumes the new branch, not the abandoned one.

The times from each rewind's ATTEMPT record to the last answer from the abandoned branch, to
the first answer after it and to the first answer from a checkpoint of the new branch are
printed (`-s`) and bounded generously; their figures are in docs/serving.md."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from ckpt.log.catalog import Catalog
from launch.ranks import spawn_ranks
from tests.integration.test_serve import Reference, ServerProc, _catalog, _job, _samples, _serving, _wait_for

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig, ReplaySeed

pytestmark = pytest.mark.integration

#: How long after a rewind's ATTEMPT record an answer may still come from the abandoned branch:
#: the server's poll (serve.poll_s = 0.1 s) and a checkpoint's apply in progress, on a shared
#: 2-core box, with room to spare. Measured: well under a second (printed).
WITHDRAW_BOUND_S = 5.0
#: From the record to the first answer from the live branch (the rebuild of the checkpoint
#: resumed from); the new branch's own first checkpoint comes later, when the trainer commits it.
READY_BOUND_S = 30.0


@dataclass(frozen=True)
class Sent:
    """One request: when it was sent and answered (wall clock), and what came back."""

    sent: float
    answered: float
    status: int
    checkpoint_id: int  # -1: not a 200
    doc: Any


class TimedLoad:
    """One client posting one body in a loop, keeping every request's times and answer."""

    def __init__(self, server: ServerProc, body: bytes) -> None:
        self.server, self.body = server, body
        self.sent: list[Sent] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.time()
            status, doc = self.server.predict(self.body)
            cid = doc["checkpoint_id"] if status == 200 else -1
            self.sent.append(Sent(t0, time.time(), status, cid, doc))
            time.sleep(0.02 if status == 200 else 0.05)  # leave the cores to the trainer

    def answered(self, cid: int, after: float = 0.0) -> bool:
        return any(s.checkpoint_id == cid and s.sent > after for s in self.sent)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def _record_unix(catalog: Catalog, resumed_from: int) -> tuple[float, int]:
    """The time of the newest ATTEMPT record that resumed from `resumed_from`, and the newest id then."""
    branch = next(b for b in reversed(catalog.branches) if b.resumed_from == resumed_from)
    (when,) = [h.created_unix for h in catalog.trainer_attempts if h.attempt == branch.attempt]
    return when, branch.newest


def _measure(load: TimedLoad, record: float, abandoned: set[int], live: set[int], newest: int, what: str) -> dict[str, float]:
    """After a rewind's record: no answer from `abandoned` once `WITHDRAW_BOUND_S` passed, and
    the times (from the record) of the last answer from it, the first from the live branch and
    the first from a checkpoint newer than `newest` (the new branch's own)."""
    late = [s for s in load.sent if s.checkpoint_id in abandoned and s.sent > record + WITHDRAW_BOUND_S]
    assert not late, (
        f"{what}: answered from abandoned checkpoint {late[0].checkpoint_id} {late[0].sent - record:.2f} s after the rewind"
    )
    after = [s for s in load.sent if s.sent > record]
    stale = [s.answered - record for s in after if s.checkpoint_id in abandoned]
    ready = [s.answered - record for s in after if s.checkpoint_id in live]
    new = [s.answered - record for s in after if s.checkpoint_id > newest]
    assert ready and ready[0] < READY_BOUND_S, f"{what}: the live branch answered {ready[:1]} s after the rewind"
    refused = [s.doc for s in after if s.status != 200]
    assert all(s.status == 503 for s in after if s.status != 200), refused[:3]
    assert all("rebuilding after a rewind" in d["error"] for d in refused), refused[:3]
    figures = {
        "last_abandoned_answer_s": max(stale, default=float("nan")),
        "first_live_answer_s": ready[0],
        "first_new_branch_answer_s": new[0] if new else float("nan"),
        "refused_503": float(len(refused)),
    }
    print(f"\n{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    return figures


def test_a_rewind_stops_answers_from_the_abandoned_branch_and_latest_resumes_the_new_one(
    tmp_path: Path, debug_config: DebugConfig, replay_seed: ReplaySeed, run_cli: CliRunner
) -> None:
    job = _job("rewind")
    run_dir = [f"run.dir={tmp_path / 'run'}"]
    cfg = debug_config.load([*job, *run_dir], check_data=False)
    body = _samples(cfg, 8, replay_seed.value)
    spawn_ranks(debug_config.path, [*job, "train.steps=40"], tmp_path, world_size=1, timeout_s=120)
    assert sorted(_catalog(cfg.ckpt).commits) == list(range(1, 9))
    server = ServerProc(debug_config.path, job, tmp_path)
    load = TimedLoad(server, body)
    try:
        _wait_for(_serving(server, 8), 60, "checkpoint 8 served", server)
        _wait_for(lambda: load.answered(8), 30, "an answer from checkpoint 8", server)

        # 1. the trainer rewinds to 3 and trains a new branch on it: 9, 10, 11 (steps 20, 25, 30)
        rewound = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=3", "train.steps=30"], tmp_path, world_size=1)
        assert "deltarec: resumed from checkpoint 3 at step 15" in rewound[0].stdout, rewound[0].stdout[-2000:]
        catalog = _catalog(cfg.ckpt)
        assert [cid for cid in sorted(catalog.commits) if catalog.abandoned(cid)] == [4, 5, 6, 7, 8]
        assert [link.checkpoint_id for link in catalog.commits[9].chain] == [1, 2, 3, 9]
        first, newest = _record_unix(catalog, 3)
        assert newest == 8
        _wait_for(_serving(server, 11), 60, "checkpoint 11 of the new branch served", server)
        _wait_for(lambda: load.answered(11), 30, "an answer from checkpoint 11", server)

        # 2. a rewind to 10 that dies before its first checkpoint (step 30): 11 is abandoned all the same
        spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=10", "train.steps=40"], tmp_path, world_size=1,
                    expect_ok=False, env_extra={"DELTAREC_KILL_AT": "step:27"})  # fmt: skip
        catalog = _catalog(cfg.ckpt)
        assert sorted(catalog.commits) == list(range(1, 12)) and catalog.abandoned(11)
        assert [m.checkpoint_id for m in catalog.restorable()][:2] == [10, 9]
        second, _ = _record_unix(catalog, 10)
        _wait_for(lambda: load.answered(10, after=second), 60, "an answer from checkpoint 10 after the second rewind", server)

        # 3. `latest` resumes from the new branch's newest checkpoint: 10, not 11 (abandoned) nor 8
        resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=30"], tmp_path, world_size=1)
        assert "deltarec: resumed from checkpoint 10 at step 25" in resumed[0].stdout, resumed[0].stdout[-2000:]
        _wait_for(_serving(server, 12), 60, "checkpoint 12 served", server)
        _wait_for(lambda: load.answered(12), 30, "an answer from checkpoint 12", server)
    finally:
        load.finish()

    one = _measure(load, first, {4, 5, 6, 7, 8}, {3, 9, 10, 11}, 8, "rewind to 3 (abandons 4-8)")
    two = _measure(load, second, {11}, {10, 12}, 11, "rewind to 10 (abandons 11), died before a checkpoint")
    assert one["first_new_branch_answer_s"] < 120  # the trainer's restore and 5 steps, then the apply
    assert two["first_live_answer_s"] < READY_BOUND_S
    # every answer is its checkpoint's export, bit for bit: the rebuilt 3 and 10 and the new branch after them
    reference = Reference(cfg, body, tmp_path)
    for cid in (3, 9, 10, 11, 12):
        answers = [s.doc["scores"] for s in load.sent if s.checkpoint_id == cid][:1]
        for got in answers:
            assert torch.equal(torch.tensor(got, dtype=torch.float32), reference(cid)), (
                f"an answer tagged {cid} is not its export"
            )
    assert server.metric("deltarec_serve_rewinds") == 2
    assert 0 < server.metric("deltarec_serve_rewind_seconds") < READY_BOUND_S
    assert "checkpoint 8 was abandoned: trainer attempt" in server.text() and "resumed from checkpoint 3" in server.text()
    assert "first response after the rewind, from checkpoint 3" in server.text()
    assert server.stop() == 0, server.tail()

    # `deltarec-ckpt list` marks the abandoned checkpoints; the live ones are complete
    listing = run_cli("trainer.ckpt_cli", "--config", debug_config.path, *run_dir, *job, "list").stdout
    status = {int(line.split()[0]): line for line in listing.splitlines() if line.split()[0].isdigit()}
    for cid in (1, 2, 3, 9, 10, 12):
        assert status[cid].endswith("complete"), listing
    for cid in (4, 5, 6, 7, 8):
        assert "abandoned: attempt " in status[cid] and status[cid].endswith("resumed from checkpoint 3"), listing
    assert "abandoned: attempt " in status[11] and status[11].endswith("resumed from checkpoint 10"), listing
