"""The markers log read while the model is built (`ckpt.log.catalog_ahead`): caught up at restore
time, it answers exactly as a read at that moment would, decoding only the records appended
since; a failed read leaves the restore to read the log itself."""

from __future__ import annotations

import threading

from ckpt.log.catalog import Catalog
from ckpt.log.catalog_ahead import CatalogAhead, catch_up_recent
from ckpt.log.markers import Marker, encode_marker
from tests.unit.test_catalog_record import RUN, MemoryLog, RunSim, _assert_answers_like, _commits_log, _link


class PreparedLog(MemoryLog):
    """A memory log with a broker's two connect calls, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0
        self.prepares = 0

    def check_reachable(self, timeout_s: float) -> None:
        self.checks += 1

    def prepare(self, timeout_s: float) -> None:
        self.prepares += 1

    @classmethod
    def of(cls, log: MemoryLog) -> PreparedLog:
        out = cls()
        out.records, out.end = list(log.records), log.end
        return out


def test_a_fold_read_ahead_and_caught_up_answers_as_a_read_at_restore_time(replay_seed) -> None:
    """Random run histories (restarts, zombies, followers, drops, catalog records): the log is
    read ahead after some records, more are appended, and the caught-up fold says what
    folding the whole log says then about every checkpoint it knows (as `read_recent_catalog`
    must), having decoded only the appended records (or, when one of them chains through a
    link the catalog record left out, having read the whole log)."""
    rng = replay_seed.rng()
    for run in range(30):
        sim = RunSim(rng, every=rng.randint(1, 6))
        for _ in range(rng.randint(10, 120)):
            sim.step()
        log = PreparedLog.of(sim.log)
        sim.log = log
        ahead = CatalogAhead(log, RUN, "markers", timeout_s=1.0)
        read = ahead.take()
        assert read is not None and read.seconds >= 0
        assert log.checks == 1 and log.prepares == 1  # a reader connected again for the catch-up
        decoded, before = read.catalog.read, len(log.records)
        for _ in range(rng.randint(0, 40)):
            sim.step()
        appended, whole_reads = len(log.records) - before, log.whole_reads
        why = f"run {run}, {appended} records appended, {replay_seed}"
        caught = catch_up_recent(read.catalog, log)
        if log.whole_reads == whole_reads + 1:
            assert caught.summary is None, why  # answered from the whole log
        else:
            assert log.whole_reads == whole_reads and caught.read == decoded + appended, why
        _assert_answers_like(caught, Catalog(RUN).feed(log.records), why)


def test_a_commit_after_the_read_ahead_is_the_one_restored() -> None:
    log = PreparedLog.of(_commits_log(100, every=10))
    read = CatalogAhead(log, RUN, "markers", timeout_s=1.0).take()
    assert read is not None
    newest = read.catalog.restorable()[0]
    later = Marker(
        kind="commit",
        run_id=RUN,
        checkpoint_id=newest.checkpoint_id + 1,
        step=0,
        world_size=2,
        chain=[newest.chain[0], _link(newest.checkpoint_id + 1, 1, False)],
        attempt="a0",
    )
    log.append_marker(encode_marker(later))
    caught = catch_up_recent(read.catalog, log)
    assert caught.restorable()[0].checkpoint_id == later.checkpoint_id
    assert log.whole_reads == 0 and caught.summary is not None


class FailingLog(PreparedLog):
    def read_tail(self, records: int):
        raise OSError("the broker went away")


def test_a_failed_read_ahead_leaves_the_restore_to_read_the_log() -> None:
    ahead = CatalogAhead(FailingLog(), RUN, "markers", timeout_s=1.0)
    assert ahead.take() is None


class HeldLog(PreparedLog):
    """A log whose tail read waits until it is let go."""

    def __init__(self) -> None:
        super().__init__()
        self.reading, self.go = threading.Event(), threading.Event()

    def read_tail(self, records: int):
        self.reading.set()
        assert self.go.wait(10)
        return super().read_tail(records)


def test_a_log_closed_during_the_read_ahead_connects_no_reader_for_the_catch_up() -> None:
    log = HeldLog()
    ahead = CatalogAhead(log, RUN, "markers", timeout_s=1.0)
    assert log.reading.wait(10)
    ahead.close()
    log.go.set()
    read = ahead.take()
    assert read is not None and read.catalog.commits == {}
    assert log.prepares == 0
