"""COMMIT markers (round trip, damage detection, selection) and the dense store."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.dense.store import JOURNAL, CommitRecord, DenseHistory, DenseRef, DenseStore, DenseStoreError
from ckpt.log.catalog import commits
from ckpt.log.markers import (
    MAGIC,
    ChainLink,
    IndexEntry,
    Marker,
    MarkerError,
    OffsetRange,
    decode_marker,
    encode_marker,
    select,
)

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed


def _marker(cid: int, kind: str = "commit", run: str = "r1") -> Marker:
    chain = [
        ChainLink(
            checkpoint_id=1,
            full=True,
            generation=0,
            ranges={0: [OffsetRange(0, 9)], 1: [OffsetRange(0, 3), OffsetRange(5, 7)]},
            rows=100,
            bytes=4000,
            index=[
                IndexEntry(partition=0, first=0, last=9, table="t", col_offset=0, min_row=0, max_row=49, cols=4),
                IndexEntry(partition=1, first=0, last=7, table="t", col_offset=0, min_row=50, max_row=99, cols=4),
            ],
        )
    ]
    if cid > 1:
        chain.append(ChainLink(checkpoint_id=cid, full=False, generation=0, ranges={0: [OffsetRange(10, 11)]}, rows=5, bytes=200))
    return Marker(
        kind=kind,
        run_id=run,
        checkpoint_id=cid,
        step=cid * 10,
        world_size=2,
        chain=chain,
        policy="incremental",
        plan={"t": "row_wise"},
        tables={"t": [100, 4]},
        encodings={"weights": "fp32"},
    )


def test_marker_round_trip() -> None:
    m = _marker(3)
    back = decode_marker(encode_marker(m))
    assert back == m
    assert back.chain[0].ranges == {0: [(0, 9)], 1: [(0, 3), (5, 7)]}
    assert all(type(r) is OffsetRange for rs in back.chain[0].ranges.values() for r in rs)
    assert back.chain[0].index[1].min_row == 50 and type(back.chain[0].index[1]) is IndexEntry
    assert not back.full and back.bytes == 200 and back.chain_bytes == 4200


# A COMMIT marker's JSON body exactly as deltarec wrote it before the index and the offset
# ranges became typed records: ranges and index entries are plain JSON lists.
_LEGACY_BODY = (
    b'{"chain":[{"bytes":3000,"checkpoint_id":1,"full":true,"generation":1,"index":[[0,0,1,"t_user",0,0,99,8],'
    b'[0,2,2,"t_item",8,5,40,8],[1,0,0,"t_user",0,100,199,8],[1,3,4,"t_item",8,41,90,8]],'
    b'"ranges":{"0":[[0,2]],"1":[[0,0],[3,4]]},"rows":12},{"bytes":300,"checkpoint_id":3,"full":false,'
    b'"generation":1,"index":[[0,5,5,"t_user",0,7,9,8]],"ranges":{"0":[[5,5]]},"rows":2}],"checkpoint_id":3,'
    b'"created_unix":1700000000.25,"dense":{"bytes":1234,"path":"/d/dense-00000003.pt","sha256":'
    b'"abababababababababababababababababababababababababababababababab"},"encodings":{"weights":"fp32"},'
    b'"error":"","format":1,"kind":"commit","plan":{"t_item":"column_wise","t_user":"row_wise"},'
    b'"policy":"one_shot_diff","run_id":"run-a","stall_ms":[1.5,2.0],"step":30,'
    b'"tables":{"t_item":[91,16],"t_user":[200,8]},"world_size":2}'
)


def test_a_marker_in_the_list_wire_form_decodes_into_records_and_encodes_back_byte_for_byte() -> None:
    data = struct.pack("<4sI", MAGIC, zlib.crc32(_LEGACY_BODY)) + _LEGACY_BODY
    m = decode_marker(data)
    assert (m.kind, m.run_id, m.checkpoint_id, m.step, m.world_size) == ("commit", "run-a", 3, 30, 2)
    base, delta = m.chain
    assert base.ranges == {0: [OffsetRange(first=0, last=2)], 1: [OffsetRange(0, 0), OffsetRange(3, 4)]}
    assert base.index[3] == IndexEntry(partition=1, first=3, last=4, table="t_item", col_offset=8, min_row=41, max_row=90, cols=8)
    assert [e.table for e in base.index] == ["t_user", "t_item", "t_user", "t_item"]
    assert delta.index == [IndexEntry(0, 5, 5, "t_user", 0, 7, 9, 8)] and not delta.full
    assert m.bytes == 300 and m.chain_bytes == 3300 and m.created_unix == 1700000000.25
    assert encode_marker(m) == data  # the wire form did not change


def test_an_index_entry_of_the_wrong_length_is_a_marker_error() -> None:
    body = _LEGACY_BODY.replace(b'[[0,5,5,"t_user",0,7,9,8]]', b'[[0,5,5,"t_user",0,7,9]]')
    with pytest.raises(MarkerError, match="bad fields"):
        decode_marker(struct.pack("<4sI", MAGIC, zlib.crc32(body)) + body)


@pytest.mark.parametrize("pos", [0, 5, 20, -2])
def test_damaged_marker_is_refused(pos: int) -> None:
    data = bytearray(encode_marker(_marker(2)))
    data[pos] ^= 0x40
    with pytest.raises(MarkerError):
        decode_marker(bytes(data))


def test_commits_and_select_ignore_failed_and_other_runs() -> None:
    recs = [(i, encode_marker(m)) for i, m in enumerate([_marker(1), _marker(2), _marker(3, "failed"), _marker(4, run="other")])]
    found = commits(recs, "r1")
    assert [m.checkpoint_id for _, m in found] == [1, 2]
    assert select(found).checkpoint_id == 2
    assert select(found, 1).checkpoint_id == 1
    assert select(found, 3) is None
    assert select([]) is None
    assert [m.checkpoint_id for _, m in commits([(0, b"garbage!"), *((i + 1, r) for i, r in recs)], "r1")] == [
        1,
        2,
    ]  # skipped, warned


def test_dense_store_round_trip_and_sha(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    store = DenseStore(tmp_path / "dense")
    w = torch.randn(3, 4, generator=replay_seed.torch_generator())
    state = {"w": w, "step": 7, "trainers": [{"reader": {"next_global_batch": 14}}], "rng": torch.get_rng_state()}
    ref = store.write(5, state)
    assert Path(ref.path).name == "dense-00000005.pt" and ref.bytes == Path(ref.path).stat().st_size
    back = store.read(DenseRef.from_json(ref.as_json()))
    assert torch.equal(back["w"], state["w"]), str(replay_seed)
    assert back["step"] == 7 and back["trainers"] == state["trainers"]
    assert not list((tmp_path / "dense").glob(".*tmp*"))
    data = bytearray(Path(ref.path).read_bytes())
    data[-10] ^= 1
    Path(ref.path).write_bytes(bytes(data))
    with pytest.raises(DenseStoreError, match="does not match its marker"):
        store.read(ref)
    store.delete([5])
    with pytest.raises(DenseStoreError, match="missing"):
        store.read(ref)


def test_dense_store_refuses_pickled_objects(tmp_path: Path) -> None:
    """weights_only loading: a file holding an arbitrary object is refused, not executed."""
    import argparse
    import hashlib

    path = tmp_path / "evil.pt"
    torch.save({"x": argparse.Namespace(payload=1)}, path)
    ref = DenseRef(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size)
    with pytest.raises(DenseStoreError, match=r"refused: .*\(GLOBAL argparse\.Namespace\)"):
        DenseStore(tmp_path).read(ref)


def test_dense_store_never_replaces_a_file(tmp_path: Path) -> None:
    store = DenseStore(tmp_path / "dense")
    ref = store.write(3, {"step": 30})
    before = Path(ref.path).read_bytes()
    with pytest.raises(DenseStoreError, match=r"dense-00000003\.pt already exists"):
        store.write(3, {"step": 0})
    assert Path(ref.path).read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "dense").iterdir()) == ["dense-00000003.pt"]  # no temp file left


def test_dense_history_counts_files_and_recorded_commits(tmp_path: Path) -> None:
    store = DenseStore(tmp_path / "dense")
    assert store.history() == DenseHistory(0, [])
    store.write(2, {"step": 20})
    store.write(7, {"step": 70})  # written, never committed (a crash before its marker)
    (tmp_path / "dense" / "dense-x.pt").write_bytes(b"")  # not a checkpoint's name
    store.record_commit(CommitRecord(1, 10, "127.0.0.1:9092 run r", 1.0))
    store.record_commit(CommitRecord(2, 20, "127.0.0.1:9092 run r", 2.0))
    with open(tmp_path / "dense" / JOURNAL, "a") as f:
        f.write('{"checkpoint_id": 3, "st')  # torn by a crash mid-append
    h = store.history()
    assert h.newest_file_id == 7 and [c.checkpoint_id for c in h.commits] == [1, 2]
    assert h.commits[1] == CommitRecord(2, 20, "127.0.0.1:9092 run r", 2.0)
    assert h.newest_id == 7
    assert DenseHistory(0, h.commits).newest_id == 2
