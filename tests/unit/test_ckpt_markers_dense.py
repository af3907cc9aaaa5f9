"""COMMIT markers (round trip, damage detection, selection) and the dense store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt.dense_store import DenseRef, DenseStore, DenseStoreError
from ckpt.markers import ChainLink, Marker, MarkerError, commits, decode_marker, encode_marker, select


def _marker(cid: int, kind: str = "commit", run: str = "r1") -> Marker:
    chain = [ChainLink(1, True, 0, {0: [[0, 9]], 1: [[0, 3], [5, 7]]}, 100, 4000)]
    if cid > 1:
        chain.append(ChainLink(cid, False, 0, {0: [[10, 11]]}, 5, 200))
    return Marker(kind, run, cid, cid * 10, 2, chain, "incremental", {"t": "row_wise"}, {"weights": "fp32"})


def test_marker_round_trip() -> None:
    m = _marker(3)
    back = decode_marker(encode_marker(m))
    assert back == m
    assert back.chain[0].ranges == {0: [[0, 9]], 1: [[0, 3], [5, 7]]}
    assert not back.full and back.bytes == 200 and back.chain_bytes == 4200


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
    with pytest.raises(MarkerError, match="position 9"):
        commits([(9, b"garbage!")], "r1")


def test_dense_store_round_trip_and_sha(tmp_path: Path) -> None:
    store = DenseStore(tmp_path / "dense")
    state = {"w": torch.randn(3, 4), "step": 7, "readers": [{"next_global_batch": 14}], "rng": torch.get_rng_state()}
    ref = store.write(5, state)
    assert Path(ref.path).name == "dense-00000005.pt" and ref.bytes == Path(ref.path).stat().st_size
    back = store.read(DenseRef.from_json(ref.as_json()))
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7 and back["readers"] == state["readers"]
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
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        DenseStore(tmp_path).read(ref)
