"""The follower applies the deltas it finds waiting in one pass (ckpt/follow/follower.py
`_follow_deltas`): every link read at once, the frames applied in chain order. Its store after a
pass is, byte for byte, the store a follower applying the same checkpoints one at a time holds,
through full checkpoints in the middle, failed and uncommitted checkpoints, rewinds that abandon
a branch, compactions and follower restarts (random histories of a simulated trainer, written
at the log level: real frames and markers in a stream held in memory)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import ckpt.follow.follower as follower_mod
from ckpt.config import FollowConfig, SinkConfig
from ckpt.events import Event, FollowApplied, FollowCompacted
from ckpt.follow.follower import Follower
from ckpt.follow.store import RowStore
from ckpt.log.backend import Backend
from ckpt.log.catalog import Catalog, catch_up
from ckpt.log.links import append_with_link, link_records
from ckpt.log.markers import (
    AttemptRecord,
    ChainLink,
    FrameMeta,
    IndexEntry,
    Marker,
    OffsetRange,
    encode_marker,
    index_frames,
)
from ckpt.quant import get_codec
from ckpt.stream.frames import Frame, OptimState, chunk_rows, decode_frame
from ckpt.stream.sink import RangeRead, RangeRecorder, SinkResult, TailRead
from common.errors import DeltarecError

RUN = "passes"
FP32 = get_codec("fp32")


# --- a stream in memory -------------------------------------------------------------------------


class MemoryStream:
    """Frames and markers in memory. Positions count records (as Kafka offsets do), per
    (generation, partition) for frames. `read_ranges` serves its reads interleaved in a random
    order, each in position order, as a broker may; it counts its calls and the frames read."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.segments: dict[tuple[int, int], list[bytes]] = {}
        self.records: list[tuple[int, bytes]] = []
        self.recorder = RangeRecorder()
        self.range_reads = 0  # read_ranges calls
        self.frames_written = 0
        self.frames_read = 0
        self.records_read = 0  # markers returned by read_markers

    # FrameSink
    def write(self, frame: bytes, *, generation: int, partition: int) -> None:
        segment = self.segments.setdefault((generation, partition), [])
        segment.append(frame)
        self.frames_written += 1
        self.recorder.add((generation, partition), len(segment) - 1, len(segment))

    def flush(self, timeout_s: float) -> SinkResult:
        result, self.recorder = self.recorder.result(), RangeRecorder()
        return result

    def generations(self) -> list[int]:
        return sorted({g for g, _ in self.segments})

    def drop_generation(self, generation: int) -> None:
        raise AssertionError("not used")

    # FrameSource
    reads_ahead_used = 0

    def read_range(self, generation: int, partition: int, first: int, last: int) -> Iterator[tuple[int, Frame]]:
        segment = self.segments[(generation, partition)]
        for pos in range(first, last + 1):
            self.frames_read += 1
            yield pos, decode_frame(segment[pos], where=f"memory g{generation} p{partition} @{pos}")

    def read_ranges(self, reads: Sequence[RangeRead]) -> Iterator[tuple[int, int, Frame]]:
        self.range_reads += 1
        pending = [(i, self.read_range(*r)) for i, r in enumerate(reads)]
        while pending:
            k = self.rng.randrange(len(pending))
            i, frames = pending[k]
            got = next(frames, None)
            if got is None:
                pending.pop(k)
            else:
                yield i, got[0], got[1]

    def prepare(self, timeout_s: float | None = None) -> None:
        """Nothing to connect (a FrameSource's and a MarkerLog's)."""

    def read_ahead(self, reads: Sequence[RangeRead]) -> None: ...

    # MarkerLog
    def append_marker(self, payload: bytes) -> int:
        self.records.append((len(self.records), payload))
        return len(self.records) - 1

    def append_markers(self, payloads: Sequence[bytes]) -> list[int]:
        return [self.append_marker(p) for p in payloads]

    def read_markers(self, start: int = 0) -> list[tuple[int, bytes]]:
        out = self.records[start:]
        self.records_read += len(out)
        return out

    def read_tail(self, records: int) -> TailRead:
        return TailRead(self.records[-records:], len(self.records) <= records)

    def check_reachable(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...

    def locate(self, generation: int, partition: int, pos: int) -> str:
        return f"memory g{generation} p{partition} @{pos}"


# --- a trainer at the log level -----------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """What one rank writes of one table: rows `lo`..`hi - 1`, columns `col`..`col + dim - 1`."""

    table: str
    rank: int
    col: int
    dim: int
    lo: int
    hi: int


#: table -> (rows, dim, sharding): `rows` splits the rows between the ranks, `columns` the columns
TABLES = {"t_rows": (48, 4, "rows"), "t_cols": (40, 6, "columns")}


def _shards(tables: dict[str, tuple[int, int, str]]) -> list[Shard]:
    out = []
    for name, (rows, dim, how) in tables.items():
        for rank in (0, 1):
            if how == "rows":
                out.append(Shard(name, rank, 0, dim, rank * rows // 2, (rank + 1) * rows // 2))
            else:
                out.append(Shard(name, rank, rank * dim // 2, dim // 2, 0, rows))
    return out


@dataclass
class State:
    """The trained values of every shard: fp32 weights and a row-wise momentum."""

    weights: dict[Shard, np.ndarray]
    momentum: dict[Shard, np.ndarray]

    def copy(self) -> State:
        return State({k: v.copy() for k, v in self.weights.items()}, {k: v.copy() for k, v in self.momentum.items()})


@dataclass
class Trainer:
    """Writes checkpoints as the trainer's writers and committer do, into a `MemoryStream`:
    frames of the changed rows (every row: a full checkpoint) per shard and rank, then the LINK
    records and the COMMIT marker naming them, rebased onto the newest compacted baseline among
    its links (ckpt/write/committer.py). It may also fail a checkpoint (a FAILED marker), leave one
    uncommitted (frames and LINK records, no marker), or rewind: a new attempt resumes from an
    older checkpoint, abandoning the ones after it."""

    stream: MemoryStream
    rng: random.Random
    tables: dict[str, tuple[int, int, str]] = field(default_factory=lambda: dict(TABLES))
    max_changed: int = 6  # rows a delta changes per shard, at most
    rewinds: bool = True  # keep each checkpoint's values, for `rewind`
    catalog: Catalog = field(default_factory=lambda: Catalog(RUN))
    cid: int = 0
    attempt: str = "a0"
    attempts: int = 0
    chain: list[ChainLink] = field(default_factory=list)  # the chain of the newest checkpoint of this attempt
    dirty: dict[Shard, set[int]] = field(default_factory=dict)  # rows changed since the last COMMIT
    states: dict[int, State] = field(default_factory=dict)  # per committed checkpoint, for rewinds
    generation: int = 0

    def __post_init__(self) -> None:
        self.shards = _shards(self.tables)
        g = self.values = np.random.default_rng(self.rng.randrange(1 << 30))
        self.state = State(
            {s: g.standard_normal((self.tables[s.table][0], s.dim), dtype=np.float32) for s in self.shards},
            {s: g.random((self.tables[s.table][0], 1), dtype=np.float32) for s in self.shards},
        )
        self.dirty = {s: set() for s in self.shards}
        self._announce(resumed_from=0)

    def _announce(self, resumed_from: int) -> None:
        self.attempt = f"a{self.attempts}"
        self.attempts += 1
        record = AttemptRecord(
            kind="attempt",
            run_id=RUN,
            role="trainer",
            attempt=self.attempt,
            world_size=2,
            created_unix=1.0e9 + self.attempts,
            resumed_from=resumed_from,
        )
        self.stream.append_marker(encode_marker(record))

    def _train(self) -> None:
        g = self.values
        for s in self.shards:
            n = self.rng.randint(0, self.max_changed)
            rows = g.choice(np.arange(s.lo, s.hi), size=min(n, s.hi - s.lo), replace=False)
            self.state.weights[s][rows] = g.standard_normal((len(rows), s.dim), dtype=np.float32)
            self.state.momentum[s][rows] += 1.0
            self.dirty[s].update(int(r) for r in rows)

    def _write(self, full: bool) -> ChainLink:
        """The checkpoint's frames; its own link."""
        self.cid += 1
        if full or not self.chain:
            self.generation = self.cid  # a full checkpoint (or the first after a rewind) opens a generation
        metas: dict[int, list[FrameMeta]] = {}
        nbytes = rows = 0
        for s in self.shards:
            ids = np.arange(s.lo, s.hi) if full else np.array(sorted(self.dirty[s]), dtype=np.int64)
            if not len(ids):
                continue
            for encoded in chunk_rows(
                run_id=RUN,
                checkpoint_id=self.cid,
                rank=s.rank,
                table=s.table,
                col_offset=s.col,
                dim=s.dim,
                encoding=FP32.code,
                row_ids=torch.from_numpy(ids.astype(np.int64)),
                payload=FP32.encode(torch.from_numpy(self.state.weights[s][ids])),
                optim=[OptimState("momentum", FP32.code, FP32.encode(torch.from_numpy(self.state.momentum[s][ids])))],
                max_frame_bytes=16384,
            ):
                self.stream.write(encoded.data, generation=self.generation, partition=s.rank)
                metas.setdefault(s.rank, []).append(FrameMeta(s.table, s.col, encoded.first_row, encoded.last_row, s.dim))
                nbytes += len(encoded.data)
            rows += len(ids)
        result = self.stream.flush(10.0)
        ranges: dict[int, list[OffsetRange]] = {}
        index: list[IndexEntry] = []
        for rank, frames in sorted(metas.items()):
            key = (self.generation, rank)
            ranges[rank] = [OffsetRange(*r) for r in result.ranges[key]]
            index.extend(index_frames(rank, result.positions[key], frames))
        return ChainLink(
            checkpoint_id=self.cid, full=full, generation=self.generation, ranges=ranges, rows=rows, bytes=nbytes, index=index
        )

    def _marker(self, kind: str, chain: list[ChainLink]) -> Marker:
        return Marker(
            kind=kind,
            run_id=RUN,
            checkpoint_id=self.cid,
            step=10 * self.cid,
            world_size=2,
            chain=chain,
            policy="incremental",
            plan={t: "row_wise" if how == "rows" else "column_wise" for t, (_, _, how) in self.tables.items()},
            tables={t: [rows, dim] for t, (rows, dim, _) in self.tables.items()},
            dense={"path": f"dense-{self.cid}.pt", "sha256": "", "bytes": 0},
            created_unix=1.0e9 + self.cid,
            attempt=self.attempt,
            error="injected" if kind == "failed" else "",
        )

    def commit(self, full: bool = False) -> int:
        """One step trained, then a checkpoint of it committed; its id."""
        self._train()
        full = full or not self.chain
        own = self._write(full)
        catch_up(self.catalog, self.stream)
        marker = self._marker("commit", [own] if full else [*self.chain, own])
        marker = (self.catalog.cheapest(marker) or marker) if len(marker.chain) > 1 else marker
        append_with_link(self.stream, marker, self.attempt)
        catch_up(self.catalog, self.stream)
        self.chain = list(self.catalog.commits[self.cid].chain)
        if self.rewinds:
            self.states[self.cid] = self.state.copy()
        self.dirty = {s: set() for s in self.shards}
        return self.cid

    def fail(self) -> None:
        """A step trained, its checkpoint written but FAILED: the next delta holds its rows too."""
        self._train()
        self._write(not self.chain)
        self.stream.append_marker(encode_marker(self._marker("failed", [])))

    def uncommitted(self) -> None:
        """A step trained, its frames and LINK records written, and no marker (the committer died
        between them): the next delta holds its rows too."""
        self._train()
        own = self._write(not self.chain)
        for record in link_records(own, run_id=RUN, writer=self.attempt):
            self.stream.append_marker(encode_marker(record))

    def rewind(self, to: int | None = None) -> int | None:
        """A new attempt resumes from an older live checkpoint (`to`, or one of the six newest):
        the ones after it are abandoned. The checkpoint resumed from, None when there is none."""
        catch_up(self.catalog, self.stream)
        live = [m for m in self.catalog.restorable() if m.checkpoint_id < self.cid]
        if not live:
            return None
        back = self.rng.choice(live[:6]) if to is None else next(m for m in live if m.checkpoint_id == to)
        self._announce(resumed_from=back.checkpoint_id)
        catch_up(self.catalog, self.stream)
        self.state = self.states[back.checkpoint_id].copy()
        self.chain = list(back.chain)  # the restore's chain goes on, in a new generation
        self.generation = self.cid + 1
        self.dirty = {s: set() for s in self.shards}
        return back.checkpoint_id


# --- followers of the stream --------------------------------------------------------------------


class Records:
    """The follower's metrics sink: every event kept."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def write(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def follower(
    stream: MemoryStream, tmp: Path, monkeypatch: pytest.MonkeyPatch, *, store: bool = False, compact_links: int = 8
) -> tuple[Follower, Records]:
    """A follower of `stream`: with `store`, it compacts (into the stream) when it holds the
    lease; else it feeds a `RowStore` of its own as a target, with no lease (so several
    followers of one stream compare their stores)."""
    sink = SinkConfig(kind="filesystem", fs_root=str(tmp), dense_dir=str(tmp))
    follow = replace(FollowConfig(), compact_links=compact_links, export_dir=str(tmp / "serving"))
    monkeypatch.setattr(follower_mod, "open_sink", lambda *_args, **_kw: _Unclosed(stream))
    records = Records()
    f = Follower(RUN, sink, follow, records, target=None if store else RowStore())
    f.backend.close()
    f.backend = Backend(stream, stream, stream, "memory", stream.locate)  # type: ignore[arg-type]
    f.lease.markers = stream  # type: ignore[assignment]
    return f, records


class _Unclosed:
    """The stream as the sink a compaction opens and closes."""

    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def close(self) -> None: ...


def rows_of(target: Any) -> dict[tuple[Any, ...], bytes]:
    """A store's content, byte for byte, independent of how wide its arrays grew: per shard, each
    tensor kind's codec per row and each written row's bytes as its codec sizes them, and the
    partition that wrote each row."""
    store: RowStore = target
    out: dict[tuple[Any, ...], bytes] = {}
    for key, shard in sorted(store.shards.items()):
        out[(key, "partition")] = shard.partition.numpy().tobytes()
        for name, rows in [("weights", shard.weights), *sorted(shard.optim.items())]:
            codes = rows.code.numpy()
            out[(key, name, "codes")] = codes.tobytes()
            for code in sorted(set(codes.tolist()) - {0}):
                out[(key, name, code)] = rows.data.numpy()[codes == code, : rows.row_bytes(code)].tobytes()
    return out


# --- the tests ----------------------------------------------------------------------------------


def test_deltas_found_waiting_are_applied_in_one_pass_then_compacted_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = random.Random(3)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng)
    f, records = follower(stream, tmp_path, monkeypatch, store=True)
    trainer.commit()
    f.poll()  # the full checkpoint, rebuilt
    for _ in range(10):
        trainer.commit()
    reads = stream.range_reads
    with caplog.at_level(logging.INFO, logger=follower_mod.__name__):
        f.poll()
    assert f.applied is not None and f.applied.checkpoint_id == 11
    assert stream.range_reads == reads + 1, "the ten links were not read at once"
    assert (f.stats.applied, f.stats.passes, f.stats.rebuilt) == (11, 2, 1)
    applied = records.of(FollowApplied)
    assert [(a.follow_ckpt, a.follow_rebuilt, a.follow_lag_ckpts) for a in applied] == [(1, True, 0), (11, False, 0)]
    assert applied[1].follow_chain == tuple(range(1, 12))  # the chain the pass left, before its compaction
    # one compaction, of the pass's newest checkpoint, not one of checkpoint 9 on the way there
    assert [c.compacted_ckpt for c in records.of(FollowCompacted)] == [11] and f.chain[0].checkpoint_id == 11
    assert "checkpoint 11 (step 110) applied (10 deltas from checkpoint 2 on)" in caplog.text


def test_a_pass_holds_at_most_max_pass_bytes_of_links(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    rng = random.Random(4)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng, max_changed=3)
    f, records = follower(stream, tmp_path, monkeypatch, compact_links=1000)
    trainer.commit()
    f.poll()
    for _ in range(12):
        trainer.commit()
    sizes = [trainer.catalog.commits[c].chain[-1].bytes for c in range(2, 14)]
    monkeypatch.setattr(follower_mod, "MAX_PASS_BYTES", sum(sizes[:4]))
    f.poll()
    passes = [a.follow_ckpt for a in records.of(FollowApplied)][1:]
    assert passes[0] == 5, passes  # four links fit, the fifth would not
    assert passes[-1] == 13 and len(passes) >= 3
    assert f.stats.applied == 13


@pytest.mark.parametrize(("pass_bytes", "prune_every"), [(None, None), (3000, None), (None, 8)])
def test_a_pass_leaves_the_store_one_by_one_application_leaves(
    tmp_path: Path,
    monkeypatch,  # noqa: ANN001
    replay_seed,  # noqa: ANN001
    pass_bytes: int | None,
    prune_every: int | None,
) -> None:
    """Three followers of one random history: one polled after every checkpoint (one at a time),
    one polled at random (passes of several deltas), restarted now and then, and one that also
    compacts, polled at random. Whenever one of them holds a checkpoint, its store is byte for
    byte what the one-at-a-time follower's store was at that checkpoint; also when they prune
    their folds every few records (`prune_every`)."""
    rng = replay_seed.rng()
    why = str(replay_seed)
    if pass_bytes is not None:
        monkeypatch.setattr(follower_mod, "MAX_PASS_BYTES", pass_bytes)  # small passes: one pass of a round ends mid-run
    if prune_every is not None:
        monkeypatch.setattr(follower_mod, "PRUNE_EVERY", prune_every)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng)
    one, one_records = follower(stream, tmp_path / "one", monkeypatch)
    batched, _ = follower(stream, tmp_path / "batched", monkeypatch)
    compactor, _ = follower(stream, tmp_path / "compactor", monkeypatch, store=True, compact_links=rng.randint(2, 6))
    seen: dict[int, dict[tuple[Any, ...], bytes]] = {}
    events = {"full": 0, "failed": 0, "uncommitted": 0, "rewind": 0, "restart": 0, "multi": 0}
    pruned = 0  # rounds after which the one-at-a-time follower's fold was pruned

    def check(f: Follower, store: Any, name: str) -> None:
        if f.applied is None:
            return
        cid = f.applied.checkpoint_id
        assert cid in seen, f"{name} holds checkpoint {cid}, which the one-at-a-time follower never held ({why})"
        assert rows_of(store) == seen[cid], f"{name}'s store at checkpoint {cid} differs ({why})"

    for _ in range(rng.randint(120, 180)):
        roll = rng.random()
        if roll < 0.06:
            trainer.commit(full=True)
            events["full"] += 1
        elif roll < 0.11:
            trainer.fail()
            events["failed"] += 1
        elif roll < 0.15:
            trainer.uncommitted()
            events["uncommitted"] += 1
        elif roll < 0.20:
            events["rewind"] += trainer.rewind() is not None
        else:
            trainer.commit()
        one.poll()
        # pruned: fewer commits than the log (a resume older than it kept makes it read the whole log again)
        pruned += one.catalog.summary is not None and len(one.catalog.commits) < len(trainer.catalog.commits)
        if one.applied is not None:
            held = rows_of(one.target)
            # held before (a rewind to it, a rebuild): the same rows again
            assert seen.setdefault(one.applied.checkpoint_id, held) == held, why
        if rng.random() < 0.25:
            passes = batched.stats.passes
            applied = batched.stats.applied
            batched.poll()
            events["multi"] += batched.stats.applied - applied > batched.stats.passes - passes
            check(batched, batched.target, "the batched follower")
        if rng.random() < 0.2:
            compactor.poll()
            check(compactor, compactor.store, "the compacting follower")
        if rng.random() < 0.03:  # a restart: a new follower jumps to the newest checkpoint
            batched.close()
            batched, _ = follower(stream, tmp_path / f"batched{events['restart']}", monkeypatch)
            events["restart"] += 1
    batched.poll()
    compactor.poll()
    check(batched, batched.target, "the batched follower")
    check(compactor, compactor.store, "the compacting follower")
    assert one.applied is not None and batched.applied is not None and compactor.applied is not None
    assert one.applied.checkpoint_id == batched.applied.checkpoint_id == compactor.applied.checkpoint_id, why
    assert one.stats.passes == one.stats.applied, f"the one-at-a-time follower applied several at once ({why})"
    assert events["multi"] and compactor.stats.compacted, (events, why)
    assert not one.stats.failed and not batched.stats.failed and not compactor.stats.failed, why
    if prune_every is not None:  # the followers' folds were pruned as they went
        assert pruned > 10, (pruned, why)
    print(events, "pruned", pruned)


def test_a_follower_prunes_no_commit_it_has_yet_to_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune between reading the log and applying what it found keeps every COMMIT after the
    one the follower holds; then one pass applies them all."""
    monkeypatch.setattr(follower_mod, "PRUNE_EVERY", 1)
    rng = random.Random(6)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng)
    f, records = follower(stream, tmp_path, monkeypatch)
    trainer.commit()
    f.poll()
    for _ in range(12):
        trainer.commit()
    catch_up(f.catalog, stream)  # read, not yet applied
    f._prune()
    assert f.catalog.summary is not None and set(range(2, 14)) <= set(f.catalog.commits), sorted(f.catalog.commits)
    f.poll()
    assert f.applied is not None and f.applied.checkpoint_id == 13
    assert [a.follow_ckpt for a in records.of(FollowApplied)] == [1, 13]


def test_a_follower_whose_pruned_fold_misses_a_rewound_chain_reads_the_whole_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower prunes its fold as it goes; a new trainer attempt then resumes from a checkpoint
    older than what it kept (a chain through links it left out): it reads the whole markers log
    once and follows the new branch, its store as a fresh follower's."""
    monkeypatch.setattr(follower_mod, "PRUNE_EVERY", 4)
    rng = random.Random(5)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng)
    f, _ = follower(stream, tmp_path / "pruned", monkeypatch)
    for i in range(30):
        trainer.commit(full=i == 10)  # 1-10 chain from 1, 11-30 from 11
        f.poll()
    assert f.catalog.summary is not None and 9 not in f.catalog.commits and 1 not in f.catalog.links
    assert len(f.catalog.commits) < 15, sorted(f.catalog.commits)
    assert trainer.rewind(to=9) == 9
    trainer.commit()  # 31: the chain 1-9, then its own link
    with caplog.at_level(logging.INFO, logger=follower_mod.__name__):
        f.poll()
    assert "reading the whole markers log" in caplog.text
    fresh, _ = follower(stream, tmp_path / "fresh", monkeypatch)
    fresh.poll()
    assert f.applied is not None and fresh.applied is not None
    assert f.applied.checkpoint_id == fresh.applied.checkpoint_id == 31
    assert rows_of(f.target) == rows_of(fresh.target)
    for _ in range(6):  # and it prunes again as it follows
        trainer.commit()
        f.poll()
    assert f.applied.checkpoint_id == 37 and 31 not in f.catalog.commits, sorted(f.catalog.commits)


def test_a_follower_holds_a_checkpoint_resumed_from_older_than_its_pruned_fold_before_any_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new trainer attempt resumes from a checkpoint older than every commit the follower's
    pruned fold kept, and has committed nothing yet: the follower drops the abandoned checkpoint
    it held and holds the resumed one at once, as a fresh follower does, instead of nothing."""
    monkeypatch.setattr(follower_mod, "PRUNE_EVERY", 4)
    rng = random.Random(5)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng)
    f, _ = follower(stream, tmp_path / "pruned", monkeypatch, store=True)
    for i in range(30):
        trainer.commit(full=i == 10)
        f.poll()
    assert f.catalog.summary is not None and 9 not in f.catalog.commits
    assert trainer.rewind(to=9) == 9
    f.poll()
    fresh, _ = follower(stream, tmp_path / "fresh", monkeypatch)
    fresh.poll()
    assert f.applied is not None and fresh.applied is not None
    assert f.applied.checkpoint_id == fresh.applied.checkpoint_id == 9
    assert rows_of(f.store) == rows_of(fresh.target)


def test_a_standby_follows_the_chain_the_trainer_rebased_not_every_link_since_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower without the lease (another one compacts) holds, for each checkpoint, the
    cheaper of its own chain and the one the trainer's marker names, rebased onto the other's
    compactions: its chain, which says when it would compact and which its records show, stays
    as short as what a restore reads instead of growing by a link a checkpoint."""
    rng = random.Random(5)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng, tables={"t": (1024, 2, "rows")}, max_changed=2, rewinds=False)
    holder, _ = follower(stream, tmp_path / "holder", monkeypatch, store=True, compact_links=4)
    standby, records = follower(stream, tmp_path / "standby", monkeypatch, store=True, compact_links=4)
    trainer.commit()
    holder.poll()  # it claims the lease first
    for _ in range(60):
        trainer.commit()
        holder.poll()
        standby.poll()
    assert holder.stats.compacted >= 10 and not standby.stats.compacted and not standby.lease.held
    chains = [len(a.follow_chain) for a in records.of(FollowApplied)]
    assert max(chains) <= 4 + 1, chains
    newest = trainer.catalog.cheapest(trainer.catalog.commits[61])
    assert newest is not None and [link.checkpoint_id for link in standby.chain] == [x.checkpoint_id for x in newest.chain]


def test_rounds_start_every_poll_s_and_one_that_took_longer_is_followed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round's work counts towards the wait before the next (a pass or a compaction that took
    longer than poll_s is followed at once, by a round that finds what was committed meanwhile);
    a round that could not read the log waits the whole poll_s."""
    clock = [0.0]
    monkeypatch.setattr(follower_mod, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    rounds: list[float | None] = [0.25, 1.5, 0.5, None, 0.1]  # seconds each round takes; None: the log unreachable
    waits: list[float] = []

    class Stop:
        def is_set(self) -> bool:
            return False

        def wait(self, timeout: float) -> bool:
            waits.append(timeout)
            clock[0] += timeout
            return False

    def poll() -> None:
        took = rounds.pop(0)
        clock[0] += took or 0.0
        if took is None:
            raise DeltarecError("no broker answered")

    f = Follower.__new__(Follower)
    f.f, f.run_id, f.follower_id = replace(FollowConfig(), poll_s=1.0), RUN, "f"
    f.backend = SimpleNamespace(where="memory")  # type: ignore[assignment]
    f.stop = Stop()  # type: ignore[assignment]
    f.poll = poll  # type: ignore[method-assign]
    f.close = lambda: None  # type: ignore[method-assign]
    f.run(until=lambda _: not rounds)
    assert waits == [0.75, 0.0, 0.5, 1.0]
