"""Markers of bounded size: each link's index is written once, in LINK records split under the
broker's message limit, and a marker names its chain by ids; the fold puts the chains back."""

from __future__ import annotations

import logging
import pickle
from dataclasses import replace

import pytest

from ckpt.log.catalog import Catalog, commits
from ckpt.log.catalog_record import summarize
from ckpt.log.links import Chain, append_with_link, assemble, by_reference, by_writer, link_records
from ckpt.log.markers import CatalogRecord, ChainLink, IndexEntry, LinkRecord, Marker, OffsetRange, decode_record, encode_marker
from tests.unit.test_catalog_record import MemoryLog

RUN = "links"


def _link(cid: int, generation: int, full: bool, ranks: int = 2, tables: int = 8) -> ChainLink:
    """A link indexing one run of frames per (rank, table): a row-wise plan's full checkpoint."""
    index = [
        IndexEntry(r, 10_000 * cid + t, 10_000 * cid + t + 2, f"table_{t:04d}", 0, 1_000 * r, 1_000 * r + 999, 128)
        for r in range(ranks)
        for t in range(tables)
    ]
    return ChainLink(
        checkpoint_id=cid,
        full=full,
        generation=generation,
        ranges={r: [OffsetRange(10_000 * cid, 10_000 * cid + tables)] for r in range(ranks)},
        rows=1_000 * ranks * tables,
        bytes=4_096 * ranks * tables,
        index=index,
        epoch=3,
    )


def _marker(chain: list[ChainLink], ranks: int = 2, tables: int = 8) -> Marker:
    cid = chain[-1].checkpoint_id
    return Marker(
        kind="commit",
        run_id=RUN,
        checkpoint_id=cid,
        step=cid,
        world_size=ranks,
        chain=chain,
        policy="incremental",
        plan={f"table_{t:04d}": "row_wise" for t in range(tables)},
        tables={f"table_{t:04d}": [1_000 * ranks, 128] for t in range(tables)},
        stall_ms=[12.5] * ranks,
        attempt="host:1:abcd",
    )


def _incremental_log(links: int) -> tuple[MemoryLog, Catalog]:
    """A trainer's log of one full checkpoint and `links - 1` deltas, each extending the last,
    its markers naming their LINK records by position, as format 2 wrote them (without building
    each chain)."""
    log, fold = MemoryLog(), Catalog(RUN)
    for cid in range(1, links + 1):
        n = len(log.records)
        parts = link_records(_link(cid, 1, cid == 1), run_id=RUN, writer="w")
        link_at = [log.append_marker(encode_marker(replace(r, format=2))) for r in parts]
        named = replace(_marker([_link(cid, 1, cid == 1)]), base=[1, 1], links=[[2, cid]] if cid > 1 else [], link_at=link_at)
        log.append_marker(encode_marker(replace(named, format=2)))
        fold.feed(log.records[n:])
    return log, fold


class _Writes(MemoryLog):
    """A memory log that counts its writes (`append_markers` calls and single appends)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def append_marker(self, payload: bytes) -> int:
        self.writes += 1
        return self._append(payload)

    def append_markers(self, payloads) -> list[int]:  # noqa: ANN001
        self.writes += 1
        return [self._append(p) for p in payloads]

    def _append(self, payload: bytes) -> int:
        return MemoryLog.append_marker(self, payload)


def test_a_marker_and_its_link_records_are_one_write_naming_them_by_writer() -> None:
    """`append_with_link` appends the LINK records and the marker in one write (one produce
    request, one fsync); on the wire the marker names them by writer and count, the fold turns
    that into their positions, as the returned marker has them, and joins the chain back."""
    log = _Writes()
    chain = [_link(1, 1, True, ranks=64, tables=200), _link(2, 1, False, ranks=64, tables=200)]
    append_with_link(log, _marker([chain[0]], ranks=64, tables=200), "host:1:abcd")
    written = append_with_link(log, _marker(chain, ranks=64, tables=200), "host:1:abcd")
    assert log.writes == 2
    wire = decode_record(log.records[-1][1])
    parts = [pos for pos, data in log.records if decode_record(data).kind == "link"]
    assert isinstance(wire, Marker) and wire.link_writer == "host:1:abcd" and wire.link_at == [] and wire.format == 3
    assert wire.link_count == len(parts) // 2 > 1  # several parts: 64 ranks x 200 tables
    assert written.link_at == parts[len(parts) // 2 :] and written.link_count == 0
    fold = Catalog(RUN).feed(log.records)
    assert list(fold.commits[2].chain) == chain and fold.link_at[2] == written.link_at and fold.parts == {}


def test_markers_by_position_and_by_writer_fold_to_the_same_chains() -> None:
    """A log of format 2 (markers naming LINK records by position) folds as before, and goes on
    after an upgrade with markers naming them by writer: the same chains as one written either way."""
    old, _ = _incremental_log(3)
    chain = [_link(cid, 1, cid == 1) for cid in range(1, 6)]
    for cid in (4, 5):
        append_with_link(old, _marker(chain[:cid]), "w")
    new = MemoryLog()
    for cid in range(1, 6):
        append_with_link(new, _marker(chain[:cid]), "w")
    folds = [Catalog(RUN).feed(log.records) for log in (old, new)]
    assert [[list(m.chain) for m in f.restorable()] for f in folds] == [[chain[:cid] for cid in range(5, 0, -1)]] * 2
    assert [f.commits[3].format for f in folds] == [2, 3]


def test_a_marker_by_writer_takes_the_newest_records_of_its_writer_for_its_checkpoint() -> None:
    """LINK records left by an earlier write of the same checkpoint by the same writer (a
    retried compaction) and those of another writer landing in between (a write split into
    several requests) are not taken: the newest of its own are."""
    log = MemoryLog()
    append_with_link(log, _marker([_link(1, 1, True)]), "w")
    chain = [_link(1, 1, True), _link(2, 1, False)]
    for link, writer in [(replace(chain[1], rows=1), "w"), (chain[1], "w"), (replace(chain[1], rows=2), "other")]:
        for part in link_records(link, run_id=RUN, writer=writer):  # the first: a write cut short before its marker
            log.append_marker(encode_marker(part))
    log.append_marker(encode_marker(by_writer(_marker(chain), "w", 1)))
    fold = Catalog(RUN).feed(log.records)
    assert list(fold.commits[2].chain) == chain


def test_a_marker_by_writer_whose_records_are_missing_is_not_restorable(caplog) -> None:
    log = MemoryLog()
    chain = [_link(cid, 1, cid == 1) for cid in range(1, 4)]
    for cid in range(1, 4):
        append_with_link(log, _marker(chain[:cid]), "host:1:abcd")
    lost = [pos for pos, data in log.records if decode_record(data).kind == "link"][-1]
    with caplog.at_level(logging.WARNING):
        fold = Catalog(RUN).feed([(pos, data) for pos, data in log.records if pos != lost])
    assert [m.checkpoint_id for m in fold.restorable()] == [2, 1]
    assert "checkpoint 3's 1 link record(s) by host:1:abcd are not all in the log (found 0)" in caplog.text


def test_a_link_split_into_parts_joins_back_exactly() -> None:
    link = _link(7, 1, True, ranks=16, tables=100)
    parts = link_records(link, run_id=RUN, writer="w", part_bytes=8_000)
    assert len(parts) > 5
    assert all(len(encode_marker(p)) <= 8_000 + 2_000 for p in parts[1:])  # the index under the limit, plus the envelope
    decoded = [decode_record(encode_marker(p)) for p in parts]
    assert all(isinstance(p, LinkRecord) for p in decoded)
    assert assemble(decoded, 7, "test") == link  # type: ignore[arg-type]


def test_mapping_entries_travel_in_link_records_and_inline_markers_as_they_are() -> None:
    """Index entries of mapping frames (cols 0) need no new format of markers or LINK records:
    a list with cols 0, back as the same typed entries."""
    link = _link(7, 1, True, ranks=2, tables=3)
    mapping = [
        IndexEntry(r, 10_000 * 7 + 50 + r, 10_000 * 7 + 52 + r, "table_0001", 0, 1_000 * r, 1_000 * r + 999, 0) for r in range(2)
    ]
    link = replace(link, index=[*link.index[:2], mapping[0], *link.index[2:], mapping[1]])
    parts = [decode_record(encode_marker(p)) for p in link_records(link, run_id=RUN, writer="w", part_bytes=300)]
    back = assemble(parts, 7, "test")  # type: ignore[arg-type]
    assert back == link and [e for e in back.index if e.is_mapping] == mapping
    inline = decode_record(encode_marker(_marker([link], ranks=2, tables=3)))
    assert (
        isinstance(inline, Marker)
        and inline.chain[0].index == link.index
        and inline.format == link_records(link, run_id=RUN, writer="w")[0].format
    )
    assert not any(e.is_mapping for e in _link(8, 1, False).index)


def test_parts_that_do_not_belong_together_are_refused() -> None:
    parts = link_records(_link(7, 1, True, ranks=16, tables=100), run_id=RUN, writer="w", part_bytes=8_000)
    other = link_records(_link(8, 1, False, ranks=16, tables=100), run_id=RUN, writer="w", part_bytes=8_000)
    with pytest.raises(ValueError, match="incomplete"):
        assemble(parts[:-1], 7, "test")
    with pytest.raises(ValueError, match="does not belong"):
        assemble([*parts[:-1], other[-1]], 7, "test")
    with pytest.raises(ValueError, match="does not belong"):
        assemble(parts, 8, "test")


def test_a_commit_marker_does_not_grow_with_its_chain() -> None:
    """The marker of the 10th link and of the 5,000th link of one chain differ only in the
    digits of their ids; carried inline, the 5,000th would be thousands of times larger."""
    sizes = {}
    for links in (10, 5_000):
        chain = [_link(cid, 1, full=cid == 1) for cid in range(1, links + 1)]
        sizes[links] = len(encode_marker(by_reference(_marker(chain), [123_456_789])))
    assert abs(sizes[5_000] - sizes[10]) <= 16, sizes
    inline = len(encode_marker(_marker([_link(cid, 1, full=cid == 1) for cid in range(1, 101)])))
    assert inline > 50 * sizes[10]


def test_ten_thousand_one_step_links_fold_once_each() -> None:
    """Each marker's chain is the chain before it plus its own link, shared: the fold keeps one
    link per checkpoint however long the chain, and gives every chain whole."""
    log, fold = _incremental_log(10_000)
    newest = fold.commits[10_000].chain
    assert isinstance(newest, Chain) and newest.prefix is fold.commits[9_999].chain
    assert len(newest) == 10_000 and [link.checkpoint_id for link in newest] == list(range(1, 10_001))
    assert newest[0] == _link(1, 1, True) and newest[-1] == _link(10_000, 1, False)
    assert newest[-3:] == [_link(cid, 1, False) for cid in (9_998, 9_999, 10_000)]
    assert fold.restorable()[0].chain_bytes == sum(link.bytes for link in newest)
    whole = Catalog(RUN).feed(log.records)
    assert whole.commits[5_000].chain == fold.commits[5_000].chain
    # what every rank gets of rank 0's choice (a broadcast pickles it), and a catalog record of
    # this fold: flat, where a pickler or deep copy recursing down the shared chain would overflow
    assert pickle.loads(pickle.dumps(fold.restorable()[0])).chain == newest
    record = decode_record(encode_marker(summarize(fold)))
    assert isinstance(record, CatalogRecord) and len(record.link_parts) == 10_000


def test_link_records_no_marker_names_are_passed_over() -> None:
    """A checkpoint killed between its LINK records and its marker leaves records nobody names:
    the next checkpoint's chain does not include them, and the fold drops them."""
    log, fold = _incremental_log(3)
    for part in link_records(_link(4, 1, False), run_id=RUN, writer="host:1:abcd"):
        log.append_marker(encode_marker(part))
    chain = [*fold.commits[3].chain, _link(5, 1, False)]
    append_with_link(log, _marker(chain), "host:1:abcd")
    again = Catalog(RUN).feed(log.records)
    assert [m.checkpoint_id for m in again.restorable()] == [5, 3, 2, 1]
    assert [link.checkpoint_id for link in again.commits[5].chain] == [1, 2, 3, 5]
    assert again.parts == {}  # the orphan went when the next marker of its writer was folded


def test_a_marker_whose_link_records_are_gone_is_not_restorable_but_its_id_stays_used(caplog) -> None:
    log, _ = _incremental_log(3)
    lost = next(pos for pos, data in log.records if decode_record(data).kind == "link" and pos > log.records[-4][0])
    records = [(pos, data) for pos, data in log.records if pos != lost]
    with caplog.at_level(logging.WARNING):
        fold = Catalog(RUN).feed(records)
    assert [m.checkpoint_id for m in fold.restorable()] == [2, 1]
    assert "checkpoint 3's link records" in caplog.text
    assert fold.damaged  # said where


def test_format_1_markers_still_fold_and_later_markers_name_their_links() -> None:
    """A log an older deltarec wrote (chains inline, format 1) goes on after an upgrade: the
    first marker by reference names links only the old markers carried."""
    log = MemoryLog()
    chain: list[ChainLink] = []
    for cid in (1, 2, 3):
        chain.append(_link(cid, 1, full=cid == 1))
        log.append_marker(encode_marker(replace(_marker(list(chain)), format=1)))  # as an older deltarec wrote it
    chain.append(_link(4, 1, False))
    append_with_link(log, _marker(list(chain)), "host:1:abcd")
    fold = Catalog(RUN).feed(log.records)
    assert [m.checkpoint_id for m in fold.restorable()] == [4, 3, 2, 1]
    assert list(fold.commits[4].chain) == chain and fold.commits[3].format == 1
    assert [m.checkpoint_id for _, m in commits(log.records, RUN)] == [1, 2, 3, 4]
