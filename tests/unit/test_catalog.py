"""The markers-log fold: lease epochs and fencing, accepted compactions, cheapest chains, drops."""

from __future__ import annotations

from dataclasses import replace

from ckpt.log.catalog import Catalog
from ckpt.log.markers import AttemptRecord, ChainLink, DroppedRecord, LeaseRecord, Marker, encode_marker
from ckpt.stream.sink import compacted_epoch, compacted_generation, generation_label, parse_rows_name, rows_name

RUN = "cat"


def _link(cid: int, *, full: bool = False, generation: int = 1, nbytes: int = 100) -> ChainLink:
    return ChainLink(checkpoint_id=cid, full=full, generation=generation, ranges={0: []}, rows=1, bytes=nbytes)


def _commit(chain: list[ChainLink], attempt: str = "") -> Marker:
    return Marker(
        kind="commit",
        run_id=RUN,
        checkpoint_id=chain[-1].checkpoint_id,
        step=10 * chain[-1].checkpoint_id,
        world_size=2,
        chain=chain,
        policy="incremental",
        attempt=attempt,
    )


def _attempt(attempt: str, role: str = "trainer", at: float = 100.0) -> AttemptRecord:
    return AttemptRecord(kind="attempt", run_id=RUN, role=role, attempt=attempt, world_size=2, created_unix=at)


def _compacted(cid: int, follower: str, epoch: int = 1, nbytes: int = 500) -> Marker:
    link = _link(cid, full=True, generation=compacted_generation(epoch, cid), nbytes=nbytes)
    return Marker(kind="compacted", run_id=RUN, checkpoint_id=cid, step=10 * cid, world_size=2, chain=[link], follower=follower)


def _lease(follower: str, event: str, at: float, lease_s: float = 10.0) -> LeaseRecord:
    return LeaseRecord(kind="lease", run_id=RUN, follower=follower, event=event, lease_s=lease_s, created_unix=at)


def _fold(*records) -> Catalog:
    return Catalog(RUN).feed((i, encode_marker(r)) for i, r in enumerate(records))


BASE = _link(1, full=True, nbytes=1000)
CHAIN = [BASE, *(_link(i) for i in range(2, 7))]  # 1000 + 5 x 100 bytes


def test_the_first_claim_holds_the_lease_and_a_second_claim_within_lease_s_is_refused() -> None:
    c = _fold(_lease("a", "claim", 100.0), _lease("b", "claim", 105.0))
    assert c.holds("a") and not c.holds("b") and c.lease.epoch == 1


def test_a_claim_after_the_holder_stopped_renewing_takes_over_with_a_new_epoch() -> None:
    c = _fold(_lease("a", "claim", 100.0), _lease("a", "renew", 103.0), _lease("b", "claim", 113.5))
    assert c.holds("b") and c.lease.epoch == 2


def test_a_renewal_keeps_the_lease_and_a_release_frees_it_at_once() -> None:
    c = _fold(_lease("a", "claim", 100.0), _lease("a", "renew", 108.0), _lease("b", "claim", 115.0))
    assert c.holds("a")
    c.feed([(3, encode_marker(_lease("a", "release", 116.0))), (4, encode_marker(_lease("b", "claim", 116.5)))])
    assert c.holds("b") and c.lease.epoch == 2


def test_only_the_lease_holders_compaction_counts_a_fenced_one_is_kept_apart() -> None:
    c = _fold(
        _commit(CHAIN),
        _lease("a", "claim", 100.0),
        _compacted(6, "a"),
        _lease("b", "claim", 200.0),
        _compacted(6, "a", nbytes=1),
        _compacted(5, "a"),
    )
    assert c.compactions[6].follower == "a" and c.compactions[6].bytes == 500
    assert 5 not in c.compactions and [m.checkpoint_id for m in c.fenced] == [6, 5]


def test_the_cheapest_chain_starts_at_a_compacted_baseline_of_one_of_its_links() -> None:
    c = _fold(_commit(CHAIN), _lease("a", "claim", 100.0), _compacted(4, "a", nbytes=600))
    best = c.cheapest(c.commits[6])
    assert [link.checkpoint_id for link in best.chain] == [4, 5, 6] and best.chain_bytes == 800
    assert best.chain[0].generation == compacted_generation(1, 4)


def test_a_compacted_baseline_dearer_than_the_chain_is_not_used() -> None:
    c = _fold(_commit(CHAIN), _lease("a", "claim", 100.0), _compacted(3, "a", nbytes=5000))
    assert c.cheapest(c.commits[6]) is c.commits[6]


def test_chains_through_a_dropped_generation_are_not_restorable() -> None:
    compacted = compacted_generation(1, 4)
    c = _fold(
        _commit(CHAIN),
        _lease("a", "claim", 100.0),
        _compacted(4, "a"),
        DroppedRecord(kind="dropped", run_id=RUN, generations=[compacted], created_unix=1.0),
    )
    assert c.cheapest(c.commits[6]) is c.commits[6]  # back to the full chain
    c.feed([(9, encode_marker(DroppedRecord(kind="dropped", run_id=RUN, generations=[1], created_unix=2.0)))])
    assert c.cheapest(c.commits[6]) is None and c.restorable() == []


def test_feeding_in_pieces_skips_what_was_read_and_other_runs_do_not_count() -> None:
    records = [(0, encode_marker(_commit(CHAIN[:2]))), (7, encode_marker(_commit(CHAIN[:3])))]
    c = Catalog(RUN).feed(records[:1])
    c.feed(records)  # a re-read from the last position returns that record again
    assert sorted(c.commits) == [2, 3] and c.records == 2 and c.read_from == 7
    other = Marker(kind="commit", run_id="other", checkpoint_id=99, step=1, world_size=1, chain=[BASE])
    assert 99 not in c.feed([(9, encode_marker(other))]).commits


def test_a_damaged_record_is_skipped_with_a_warning_naming_its_position(caplog) -> None:
    good = [(0, encode_marker(_commit([BASE]))), (4, b"DRM1\0\0\0\0{}"), (9, encode_marker(_commit(CHAIN[:2])))]
    c = Catalog(RUN).feed(good, "markers of x")
    assert sorted(c.commits) == [1, 2] and c.damaged == [4] and c.last_pos == 9
    assert any("markers of x position 4: marker record CRC mismatch; record skipped" in r.getMessage() for r in caplog.records)


def test_markers_of_an_attempt_after_a_newer_attempt_started_are_fenced() -> None:
    """The newest ATTEMPT record holds the run from its position on: the old attempt's COMMIT
    that lands after it is ignored (and listed), even with a new id; ids still never repeat."""
    c = _fold(
        _attempt("a"),
        _commit([BASE], "a"),
        _commit(CHAIN[:2], "a"),
        _attempt("b"),
        _commit(CHAIN[:3], "a"),
        _commit([_link(4, full=True, generation=4)], "b"),
    )
    assert sorted(c.commits) == [1, 2, 4] and [m.checkpoint_id for m in c.fenced_commits] == [3]
    # an epoch is the record's position + 1
    assert c.holder("trainer").attempt == "b" and c.holder("trainer").epoch == 4 and c.epochs_of == {"a": 1, "b": 4}
    assert c.newest_id == 4 and [m.checkpoint_id for m in c.restorable()] == [4, 2, 1]


def test_markers_before_any_attempt_record_count_and_a_marker_without_attempt_after_one_does_not() -> None:
    c = _fold(_commit([BASE]), _attempt("a"), _commit(CHAIN[:2]), _commit(CHAIN[:3], "a"))
    assert sorted(c.commits) == [1, 3] and [m.checkpoint_id for m in c.fenced_commits] == [2]


def test_an_attempt_whose_own_record_was_damaged_keeps_its_markers() -> None:
    records = [
        (0, encode_marker(_attempt("a"))),
        (1, encode_marker(_commit([BASE], "a"))),
        (2, b"DRM1 damaged attempt record of b"),
        (3, encode_marker(_commit(CHAIN[:2], "b"))),
    ]
    c = Catalog(RUN).feed(records)
    assert sorted(c.commits) == [1, 2] and not c.fenced_commits and c.damaged == [2]


def test_trainer_and_gc_attempts_hold_separately() -> None:
    c = _fold(_attempt("t1"), _attempt("g1", "gc"), _attempt("g2", "gc"), _commit([BASE], "t1"))
    assert c.holder("trainer").attempt == "t1" and c.holder("gc").attempt == "g2" and c.holder("gc").epoch == 3
    assert sorted(c.commits) == [1]


def test_compacted_generations_have_their_own_names_and_never_meet_the_trainers() -> None:
    g = compacted_generation(3, 41)
    assert g < 0 and rows_name(RUN, g) == f"{RUN}.rows.e3.c41" and generation_label(g) == "e3.c41"
    assert generation_label(41) == "g41" and compacted_generation(3, 41) != compacted_generation(4, 41)


def test_generation_names_parse_back_and_other_names_do_not() -> None:
    for g in (1, 41, compacted_generation(1, 7), compacted_generation(12, 123456)):
        assert parse_rows_name(RUN, rows_name(RUN, g)) == g
    assert compacted_epoch(compacted_generation(12, 5)) == 12
    for name in (f"{RUN}.markers", f"{RUN}.rows.gx", "other.rows.g1", f"{RUN}x.rows.g1", f"{RUN}.rows.e1"):
        assert parse_rows_name(RUN, name) is None


def test_markers_folded_share_the_fields_a_job_repeats_and_keep_their_own() -> None:
    """A fold of a checkpoint every step keeps one copy of the plan, tables and codecs every
    marker repeats, not one per marker; a field that changes (a new plan after a reshard) is
    the marker's own, and each keeps its own dense file."""
    plan, tables = {"t_user": "row_wise", "t_item": "table_wise"}, {"t_user": [2000, 16], "t_item": [1000, 16]}

    def commit(cid: int, plan: dict[str, str]) -> Marker:
        return replace(_commit([*CHAIN[: cid - 1], _link(cid)] if cid > 1 else [BASE]), plan=plan, tables=tables,
                       encodings={"weights": "fp32"}, dense={"path": f"dense-{cid}"})  # fmt: skip

    c = _fold(
        commit(1, plan), commit(2, plan), commit(3, {**plan, "t_item": "row_wise"}), commit(4, {**plan, "t_item": "row_wise"})
    )
    m1, m2, m3, m4 = (c.commits[i] for i in (1, 2, 3, 4))
    assert m2.plan is m1.plan and m2.tables is m1.tables and m2.encodings is m1.encodings and m4.tables is m1.tables
    assert m3.plan is not m1.plan and m3.plan == {**plan, "t_item": "row_wise"} and m4.plan is m3.plan
    assert [m.dense["path"] for m in (m1, m2, m3, m4)] == ["dense-1", "dense-2", "dense-3", "dense-4"]
    assert m1.plan == plan and m1.tables == tables
