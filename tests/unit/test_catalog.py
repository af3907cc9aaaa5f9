"""The markers-log fold: lease epochs and fencing, accepted compactions, cheapest chains, drops."""

from __future__ import annotations

import pytest

from ckpt.catalog import Catalog
from ckpt.markers import ChainLink, DroppedRecord, LeaseRecord, Marker, MarkerError, encode_marker
from ckpt.sink import compacted_epoch, compacted_generation, generation_label, parse_rows_name, rows_name

RUN = "cat"


def _link(cid: int, *, full: bool = False, generation: int = 1, nbytes: int = 100) -> ChainLink:
    return ChainLink(checkpoint_id=cid, full=full, generation=generation, ranges={0: []}, rows=1, bytes=nbytes)


def _commit(chain: list[ChainLink]) -> Marker:
    return Marker(kind="commit", run_id=RUN, checkpoint_id=chain[-1].checkpoint_id, step=10 * chain[-1].checkpoint_id,
                  world_size=2, chain=chain, policy="incremental")


def _compacted(cid: int, follower: str, epoch: int = 1, nbytes: int = 500) -> Marker:
    link = _link(cid, full=True, generation=compacted_generation(epoch, cid), nbytes=nbytes)
    return Marker(kind="compacted", run_id=RUN, checkpoint_id=cid, step=10 * cid, world_size=2, chain=[link],
                  follower=follower)


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
    c = _fold(_commit(CHAIN), _lease("a", "claim", 100.0), _compacted(6, "a"),
              _lease("b", "claim", 200.0), _compacted(6, "a", nbytes=1), _compacted(5, "a"))
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
    c = _fold(_commit(CHAIN), _lease("a", "claim", 100.0), _compacted(4, "a"),
              DroppedRecord(kind="dropped", run_id=RUN, generations=[compacted], created_unix=1.0))
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


def test_a_damaged_record_is_an_error_naming_its_position() -> None:
    with pytest.raises(MarkerError, match="position 4"):
        Catalog(RUN).feed([(4, b"DRM1\0\0\0\0{}")])


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
