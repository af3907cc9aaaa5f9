"""A restore after ten thousand one-step links reads a short chain: the follower's compactions
bound the chain of the checkpoint a restore picks, however long the run.

Bound: a follower polled at least once every `k` checkpoints applies, each poll, every
checkpoint waiting, then compacts when the deltas after its baseline reach `compact_links`
(ckpt/follow/follower.py `_due`). So after a poll its chain is a baseline plus fewer than
`compact_links` deltas, and until the next one at most `k` checkpoints follow: the newest
checkpoint's cheapest chain (`Catalog.cheapest`, what a restore and the trainer's next marker
use) is at most 1 + (compact_links - 1) + k = compact_links + k links. Each link is read once and
the log is read on from where the last read stopped, so a poll costs what arrived since the
last one, not what the run holds.

The trainer is simulated at the log level (tests/unit/test_follow_passes.py `Trainer`: real
frames, LINK records and COMMIT markers by reference, rebased onto the newest compacted baseline
as the committer does), in memory: ten thousand real training steps would take hours here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckpt.follow.follower import FollowStats
from ckpt.log.catalog import catch_up
from tests.unit.test_follow_passes import MemoryStream, Trainer, follower

LINKS = 10_000
COMPACT_LINKS = 8  # ckpt.follow.compact_links' default


class CountingReads:
    """The follower's view of the markers log: the records each read returned, counted."""

    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream
        self.records_read = 0

    def read_markers(self, start: int = 0) -> list[tuple[int, bytes]]:
        out = self.stream.read_markers(start)
        self.records_read += len(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def test_a_restore_after_ten_thousand_one_step_links_reads_a_bounded_chain(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    replay_seed,  # noqa: ANN001
) -> None:
    rng = replay_seed.rng()
    k = rng.randint(1, 6)  # the follower polls after 1..k checkpoints
    bound = COMPACT_LINKS + k
    why = f"polls every 1..{k} checkpoints, bound {bound} links, {replay_seed}"
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng, tables={"t": (1024, 2, "rows")}, max_changed=2, rewinds=False)
    f, _ = follower(stream, tmp_path, monkeypatch, store=True, compact_links=COMPACT_LINKS)
    reads = CountingReads(stream)
    f.backend.markers = f.lease.markers = reads  # type: ignore[assignment]
    polls = frames_written = 0
    longest: list[int] = []  # the chain a restore reads, right after each COMMIT
    due = 1  # the first poll rebuilds the full checkpoint 1; every later one applies deltas
    for n in range(1, LINKS + 1):
        before = stream.frames_written
        cid = trainer.commit(full=n == 1)
        frames_written += stream.frames_written - before  # the trainer's, not the follower's compactions
        best = trainer.catalog.cheapest(trainer.catalog.commits[cid])
        assert best is not None
        longest.append(len(best.chain))
        assert len(best.chain) <= bound, f"checkpoint {cid}: a restore reads {len(best.chain)} links ({why})"
        due -= 1
        if due == 0:
            f.poll()
            polls += 1
            due = rng.randint(1, k)
    f.poll()
    polls += 1
    stats: FollowStats = f.stats
    assert f.applied is not None and f.applied.checkpoint_id == LINKS, why
    assert stats.applied == LINKS and stats.rebuilt == 1 and not stats.failed, (stats, why)
    assert stats.compacted >= LINKS // (COMPACT_LINKS + k), (stats, why)
    catch_up(trainer.catalog, stream)  # the trainer folds the last poll's COMPACTED marker, as at its next commit
    newest = trainer.catalog.cheapest(trainer.catalog.commits[LINKS])
    assert newest is not None and len(newest.chain) <= COMPACT_LINKS, why  # the last poll compacted when due
    assert newest.chain[0].checkpoint_id in trainer.catalog.compactions, why
    # every link read once (the first poll rebuilt checkpoint 1 alone); the log read on, never again from its start
    assert stream.frames_read == frames_written, (stream.frames_read, frames_written, why)
    assert reads.records_read <= len(stream.records) + 8 * polls, (reads.records_read, len(stream.records), polls, why)
    print(f"{why}: chain a restore reads: max {max(longest)}, at the end {len(newest.chain)}; {stats}")
