"""Catalog records: a restore folds the markers log from the newest one on and gets, for the
newest checkpoints, exactly what folding the whole log gives; it reads only the log's tail."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from ckpt.log.catalog import Catalog
from ckpt.log.catalog_record import TAIL_READ, from_record, prune, read_recent_catalog, summarize
from ckpt.log.links import append_with_link
from ckpt.log.markers import (
    AttemptRecord,
    ChainLink,
    DroppedRecord,
    LeaseRecord,
    Marker,
    MarkerError,
    SurvivorRecord,
    decode_record,
    encode_marker,
    is_catalog_record,
)
from ckpt.recovery.partial import usable_survivors
from ckpt.stream.sink import TailRead, compacted_generation

RUN = "cr"


class MemoryLog:
    """A markers log in memory whose positions are byte offsets, as the filesystem sink's; it
    counts whole-log reads."""

    def __init__(self) -> None:
        self.records: list[tuple[int, bytes]] = []
        self.end = 0
        self.whole_reads = 0
        self.tail_reads: list[int] = []

    def append_marker(self, payload: bytes) -> int:
        pos, self.end = self.end, self.end + 12 + len(payload)
        self.records.append((pos, payload))
        return pos

    def append_markers(self, payloads: Sequence[bytes]) -> list[int]:
        return [self.append_marker(p) for p in payloads]

    def read_markers(self, start: int = 0) -> list[tuple[int, bytes]]:
        if start == 0:
            self.whole_reads += 1
        return [r for r in self.records if r[0] >= start]

    def read_tail(self, records: int) -> TailRead:
        self.tail_reads.append(records)
        return TailRead(self.records[-records:], len(self.records) <= records)

    def prefix(self, n: int) -> MemoryLog:
        log = MemoryLog()
        for _, payload in self.records[:n]:
            log.append_marker(payload)
        return log


def _link(cid: int, generation: int, full: bool) -> ChainLink:
    return ChainLink(
        checkpoint_id=cid, full=full, generation=generation, ranges={0: [(cid, cid)]}, rows=cid, bytes=100 if not full else 1000
    )


@dataclass
class RunSim:
    """A run's history drawn at random: trainer attempts (some restarting from an older
    checkpoint, some zombies committing after their replacement), failed checkpoints,
    followers' leases and compactions, gc drops, survivor snapshots, and catalog records
    the committer appends every `every` records."""

    rng: random.Random
    log: MemoryLog = field(default_factory=MemoryLog)
    fold: Catalog = field(default_factory=lambda: Catalog(RUN))
    attempt: str = "a0"
    zombie: str = ""
    next_id: int = 1
    chain: list[ChainLink] = field(default_factory=list)
    clock: float = 1000.0
    every: int = 3
    by_reference: bool = False  # commits and compactions name their links, as deltarec writes them
    compacted: set[int] = field(default_factory=set)  # the compacted generations written so far
    prune: bool = False  # the fold writes every catalog record and is pruned to it, as rank 0's committer's

    def append(self, record) -> None:
        if self.by_reference and isinstance(record, Marker) and record.kind != "failed":
            n = len(self.log.records)
            append_with_link(self.log, record, record.attempt or record.follower)
            self.fold.feed(self.log.records[n:])
            return
        pos = self.log.append_marker(encode_marker(record))
        self.fold.feed([(pos, self.log.records[-1][1])])

    def commit(self, attempt: str) -> None:
        cid, self.next_id = self.next_id, self.next_id + 1
        if not self.chain or self.rng.random() < 0.15:
            self.chain = [_link(cid, cid, True)]
        else:
            self.chain = [*self.chain, _link(cid, self.chain[0].generation, False)]
        kind = "failed" if self.rng.random() < 0.05 else "commit"
        self.append(
            Marker(
                kind=kind,
                run_id=RUN,
                checkpoint_id=cid,
                step=10 * cid,
                world_size=2,
                chain=list(self.chain) if kind == "commit" else [],
                attempt=attempt,
            )
        )
        if kind == "failed" or attempt != self.attempt:  # a zombie's links are no chain's of the run
            self.chain = self.chain[:-1]
        elif self.fold.since_summary >= self.every:  # as the committer does, from its own fold
            source = self.fold if self.prune or self.rng.random() < 0.5 else read_recent_catalog(self.log, RUN)
            if source.exact:
                record = summarize(source, keep=self.rng.randint(1, 4))
                if self.prune:
                    prune(self.fold, record)
                self.append(record)

    def restart(self) -> None:
        """A new trainer attempt restores the newest checkpoint, or now and then an older one
        (of the whole log's: older than what a pruned fold kept too); most say which."""
        if self.rng.random() < 0.3:
            self.zombie = self.attempt
        self.attempt = f"a{self.next_id}x{self.rng.randrange(1000)}"
        found = (Catalog(RUN).feed(self.log.records) if self.rng.random() < 0.3 else self.fold).restorable()
        pick = (found[0] if self.rng.random() < 0.7 else self.rng.choice(found)) if found else None
        said = self.rng.random() < 0.7  # else an attempt of a version that did not say (no branch)
        self.announce((pick.checkpoint_id if pick else 0) if said else -1)
        self.chain = list(pick.chain) if pick else []

    def announce(self, resumed_from: int) -> None:
        """The ATTEMPT record of `self.attempt`, which resumed from `resumed_from` (-1: not said)."""
        attempt, clock = self.attempt, self.clock
        self.append(
            AttemptRecord(
                kind="attempt",
                run_id=RUN,
                role="trainer",
                attempt=attempt,
                world_size=2,
                created_unix=clock,
                resumed_from=resumed_from,
            )
        )

    def step(self) -> None:
        self.clock += self.rng.uniform(0.5, 8.0)
        r = self.rng.random()
        if r < 0.45:
            self.commit(self.attempt)
        elif r < 0.50 and self.zombie:
            self.commit(self.zombie)  # fenced: after its replacement's ATTEMPT record
        elif r < 0.56:
            self.restart()
        elif r < 0.70:
            follower = self.rng.choice(["f1", "f2"])
            event = self.rng.choice(["claim", "claim", "renew", "release"])
            self.append(
                LeaseRecord(kind="lease", run_id=RUN, follower=follower, event=event, lease_s=10.0, created_unix=self.clock)
            )
        elif r < 0.80 and self.chain:
            link = self.rng.choice(self.chain)
            epoch = self.fold.lease.epoch if self.fold.lease else 1
            generation = compacted_generation(epoch, link.checkpoint_id)
            if generation in self.compacted:  # a follower compacts a checkpoint once an epoch: one generation, one marker
                return
            self.compacted.add(generation)
            base = ChainLink(
                checkpoint_id=link.checkpoint_id,
                full=True,
                bytes=self.rng.choice([50, 500, 5000]),
                generation=generation,
                ranges={0: [(0, 1)]},
                rows=1,
            )
            self.append(
                Marker(
                    kind="compacted",
                    run_id=RUN,
                    checkpoint_id=link.checkpoint_id,
                    step=0,
                    world_size=2,
                    chain=[base],
                    follower=self.rng.choice(["f1", "f2"]),
                )
            )
        elif r < 0.84:
            generations = sorted({link.generation for m in self.fold.commits.values() for link in m.chain})
            if generations:
                self.append(
                    DroppedRecord(kind="dropped", run_id=RUN, generations=[self.rng.choice(generations)], created_unix=self.clock)
                )
        elif r < 0.90 and self.fold.commits:
            cid, self.next_id = self.next_id, self.next_id + 1
            base = max(self.fold.commits)
            self.append(
                SurvivorRecord(
                    kind="survivor",
                    run_id=RUN,
                    attempt=self.attempt,
                    rank=self.rng.randint(0, 1),
                    world_size=2,
                    base=base,
                    step=10 * cid,
                    link=_link(cid, cid, False),
                    dense={"path": f"s{cid}"},
                    created_unix=self.clock,
                )
            )
        elif r < 0.93:
            self.append(
                AttemptRecord(
                    kind="attempt", run_id=RUN, role="gc", attempt=f"gc{self.next_id}", world_size=1, created_unix=self.clock
                )
            )
        else:
            self.commit(self.attempt)


def _chains(markers: list[Marker]) -> list[tuple[int, list[tuple[int, int]]]]:
    return [(m.checkpoint_id, [(link.checkpoint_id, link.generation) for link in m.chain]) for m in markers]


def _assert_answers_like(recent: Catalog, whole: Catalog, why: str) -> None:
    """`recent` gives, for the checkpoints it knows, what the whole log's fold gives."""
    floor = recent.summary.oldest_kept if recent.summary else 0
    assert _chains(recent.restorable()) == _chains([m for m in whole.restorable() if m.checkpoint_id >= floor]), why
    assert recent.newest_id == whole.newest_id, why
    assert recent.holders == whole.holders and recent.epochs_of == whole.epochs_of, why
    assert recent.trainer_attempts == whole.trainer_attempts, why
    assert recent.lease == whole.lease and recent.epochs == whole.epochs, why
    assert recent.dropped == whole.dropped, why
    assert recent.last_pos == whole.last_pos, why
    newest = whole.restorable()[:1]
    if newest and newest[0].checkpoint_id >= floor:
        assert usable_survivors(recent, newest[0]) == usable_survivors(whole, newest[0]), why


@pytest.mark.parametrize("by_reference", [False, True], ids=["inline", "by-reference"])
def test_a_fold_from_the_newest_catalog_record_answers_as_the_whole_log_does(replay_seed, by_reference: bool, caplog) -> None:
    rng = replay_seed.rng()
    for run in range(30):
        sim = RunSim(rng, every=rng.randint(1, 6), by_reference=by_reference)
        for _ in range(rng.randint(20, 160)):
            sim.step()
        for n in sorted(rng.sample(range(1, len(sim.log.records) + 1), min(8, len(sim.log.records)))):
            why = f"run {run}, first {n} records, {replay_seed}"
            log = sim.log.prefix(n)
            whole = Catalog(RUN).feed(log.records)
            recent = read_recent_catalog(log, RUN)
            assert recent.exact, why
            _assert_answers_like(recent, whole, why)
    assert "an older catalog record serves" not in caplog.text, replay_seed  # every record is whole


def test_a_fold_pruned_to_each_catalog_record_it_writes_answers_as_the_whole_log_does(replay_seed) -> None:
    """Rank 0's committer prunes its fold to each catalog record it writes: fed on, the fold
    says what the whole log's fold says of the checkpoints it kept, while it stays exact, and
    who holds the run always. A long run of short chains keeps a few checkpoints, not all."""
    rng = replay_seed.rng()
    compared = 0
    for run in range(30):
        sim = RunSim(rng, every=rng.randint(1, 6), by_reference=rng.random() < 0.5, prune=True)
        for step in range(rng.randint(20, 160)):
            sim.step()
            if rng.random() > 0.1:
                continue
            why = f"run {run}, step {step}, {replay_seed}"
            whole = Catalog(RUN).feed(sim.log.records)
            assert sim.fold.holders == whole.holders and sim.fold.newest_id == whole.newest_id, why
            if sim.fold.exact and sim.fold.summary is not None:
                _assert_answers_like(sim.fold, whole, why)
                compared += 1
    assert compared > 30, (compared, replay_seed)  # pruned folds were compared, not only whole ones

    long = RunSim(random.Random(replay_seed.rng().randrange(2**32)), every=4, prune=True)
    long.chain = [_link(1, 1, True)]
    long.next_id = 2
    for _ in range(2000):
        long.commit(long.attempt)
    assert long.fold.exact and long.fold.summary is not None, replay_seed
    whole = Catalog(RUN).feed(long.log.records)
    assert len(whole.commits) > 1500 and len(long.fold.commits) <= 4 + 4 + 1, (len(long.fold.commits), replay_seed)
    assert len(long.fold.links) <= len({link.checkpoint_id for m in long.fold.commits.values() for link in m.chain})
    _assert_answers_like(long.fold, whole, str(replay_seed))


def test_a_resume_from_a_checkpoint_older_than_the_kept_ones_makes_the_fold_read_the_whole_log() -> None:
    """A trainer attempt resumes from a checkpoint older than every commit the newest catalog
    record kept, abandoning those: a fold from the record (or pruned to it) cannot name the
    live branch's newest checkpoint, so it turns inexact, and a restore's fold is the whole
    log's, whose newest restorable checkpoint is the one resumed."""
    sim = RunSim(random.Random(3), every=4, by_reference=True, prune=True)
    for _ in range(40):
        sim.commit(sim.attempt)
    assert sim.fold.exact and sim.fold.summary is not None
    whole = Catalog(RUN).feed(sim.log.records)
    older = [m.checkpoint_id for m in whole.restorable() if m.checkpoint_id < sim.fold.summary.oldest_kept]
    assert older, (sorted(sim.fold.commits), [m.checkpoint_id for m in whole.restorable()])
    resumed = older[len(older) // 2]
    sim.attempt = "a99"
    sim.announce(resumed)
    assert not sim.fold.exact
    recent = read_recent_catalog(sim.log, RUN)
    assert recent.summary is None and [m.checkpoint_id for m in recent.restorable()][:1] == [resumed]


def test_a_log_by_reference_folds_to_the_chains_of_the_same_log_inline(replay_seed) -> None:
    """The same run written both ways: every restorable checkpoint has the same chain, link for
    link (LINK records joined back, chains put together from ids), and the same catalog facts."""
    seed = replay_seed.rng().randrange(2**32)
    for run in range(10):
        inline, named = (RunSim(random.Random(seed + run), by_reference=b) for b in (False, True))
        for _ in range(150):
            inline.step()
            named.step()
        why = f"run {run}, {replay_seed}"
        assert [(m.checkpoint_id, list(m.chain)) for m in named.fold.restorable()] == [
            (m.checkpoint_id, list(m.chain)) for m in inline.fold.restorable()
        ], why
        assert named.fold.newest_id == inline.fold.newest_id and named.fold.dropped == inline.fold.dropped, why
        assert sorted(named.fold.compactions) == sorted(inline.fold.compactions), why


def test_catalog_records_change_nothing_the_fold_says(replay_seed) -> None:
    rng = replay_seed.rng()
    sim = RunSim(rng, every=2)
    for _ in range(200):
        sim.step()
    without = [(pos, data) for pos, data in sim.log.records if not is_catalog_record(data)]
    assert len(without) < len(sim.log.records), replay_seed
    bare, fold = Catalog(RUN).feed(without), Catalog(RUN).feed(sim.log.records)
    assert _chains(fold.restorable()) == _chains(bare.restorable()), replay_seed
    assert fold.newest_id == bare.newest_id and fold.holders == bare.holders, replay_seed


def _commits_log(n: int, every: int) -> MemoryLog:
    """A trainer's log: one full checkpoint, then deltas, a catalog record every `every` records."""
    sim = RunSim(random.Random(0), every=every)
    sim.chain = [_link(1, 1, True)]
    sim.next_id = 2
    for _ in range(n):
        cid, sim.next_id = sim.next_id, sim.next_id + 1
        sim.chain = [sim.chain[0], _link(cid, 1, False)]
        sim.append(Marker(kind="commit", run_id=RUN, checkpoint_id=cid, step=cid, world_size=2, chain=sim.chain, attempt="a0"))
        if sim.fold.since_summary >= every:
            sim.append(summarize(sim.fold))
    return sim.log


def test_a_restore_reads_the_tail_of_a_long_log_only() -> None:
    log = _commits_log(3000, every=32)
    recent = read_recent_catalog(log, RUN)
    assert log.whole_reads == 0 and log.tail_reads == [TAIL_READ]
    assert recent.read <= TAIL_READ and recent.summary is not None
    assert recent.restorable()[0].checkpoint_id == 3001
    ids = [m.checkpoint_id for m in recent.restorable()]
    assert ids == list(range(3001, 3001 - len(ids), -1)) and len(ids) >= 4  # the kept ones and those after it


def test_a_tail_without_a_catalog_record_is_read_wider_until_one_or_the_start() -> None:
    log = _commits_log(250, every=150)  # one catalog record, 100 records before the end
    recent = read_recent_catalog(log, RUN)
    assert recent.summary is not None and log.tail_reads == [TAIL_READ, TAIL_READ * 8]
    assert log.whole_reads == 0
    old = MemoryLog()  # a log of a deltarec without catalog records
    for _pos, data in log.records:
        if not is_catalog_record(data):
            old.append_marker(data)
    recent = read_recent_catalog(old, RUN)
    assert recent.summary is None and _chains(recent.restorable()) == _chains(Catalog(RUN).feed(old.records).restorable())


def test_a_damaged_catalog_record_is_skipped_and_an_older_one_serves(caplog) -> None:
    log = _commits_log(100, every=10)
    newest = max(i for i, (_, data) in enumerate(log.records) if is_catalog_record(data))
    pos, data = log.records[newest]
    log.records[newest] = (pos, data[:-3] + b"}}}")
    with pytest.raises(MarkerError):
        decode_record(log.records[newest][1])
    recent = read_recent_catalog(log, RUN)
    assert recent.summary is not None and recent.summary.upto < pos
    assert _chains(recent.restorable())[:1] == _chains(Catalog(RUN).feed(log.records).restorable())[:1]
    assert f"position {pos}" in caplog.text and "an older catalog record serves" in caplog.text


def test_a_chain_through_a_link_the_record_left_out_is_answered_from_the_whole_log() -> None:
    """An attempt that restored an old checkpoint (its newer ones all failed) continues that
    checkpoint's chain; the compacted baselines of its links may be in the part of the log
    the catalog record summarised away, so the reader folds the whole log."""
    log = _commits_log(100, every=10)
    fold = Catalog(RUN).feed(log.records)
    old = fold.commits[5]
    log.append_marker(
        encode_marker(
            Marker(
                kind="commit",
                run_id=RUN,
                checkpoint_id=102,
                step=102,
                world_size=2,
                chain=[*old.chain, _link(102, 1, False)],
                attempt="a0",
            )
        )
    )
    whole_reads = log.whole_reads
    recent = read_recent_catalog(log, RUN)
    assert log.whole_reads == whole_reads + 1 and recent.summary is None
    assert recent.restorable()[0].checkpoint_id == 102


def test_a_catalog_record_round_trips_through_its_envelope() -> None:
    sim = RunSim(random.Random(7), every=1000)
    for _ in range(120):
        sim.step()
    record = summarize(sim.fold, keep=3)
    kept = from_record(record)
    assert _chains(kept.restorable()) == _chains(sim.fold.restorable()[:3]) and len(kept.restorable()) == 3
    data = encode_marker(record)
    assert is_catalog_record(data) and not is_catalog_record(encode_marker(sim.fold.commits[max(sim.fold.commits)]))
    back = decode_record(data)
    assert back == record
    _assert_answers_like(from_record(back), sim.fold, "round trip")
    wrong = b"DRM1" + data[4:]  # a catalog record's body in a marker's envelope
    with pytest.raises(MarkerError, match="envelope"):
        decode_record(wrong)


def test_a_catalog_record_written_late_is_folded_from_its_own_position_on() -> None:
    """A catalog record of the log as it was 100 records earlier (its writer read the log,
    then others appended): what came after that read must be folded too, so the tail read
    widens to reach it."""
    log = _commits_log(20, every=1000)
    stale = summarize(Catalog(RUN).feed(log.records))
    later = _commits_log(120, every=1000).records[len(log.records) :]
    for _, data in later:
        log.append_marker(data)
    log.append_marker(encode_marker(stale))
    recent = read_recent_catalog(log, RUN)
    assert recent.summary is not None and recent.summary.upto == stale.upto and log.tail_reads == [TAIL_READ, TAIL_READ * 8]
    _assert_answers_like(recent, Catalog(RUN).feed(log.records), "a late catalog record")
    assert recent.restorable()[0].checkpoint_id == 121
