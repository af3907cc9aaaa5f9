"""Managed-collision mapping records (ckpt/stream/mapping.py) and the mapping frames that carry
them (ckpt/stream/frames.py, FLAG_MAPPING).

The "DMC1" layout pinned byte for byte on hand-made states; byte-exact round trips of full and
delta records of random shard states (seed printed) for the three eviction policies' counters
(counts only, last access only, both), the history kept across deltas included; `record_for`
choosing the smaller record; damaged, truncated and newer records refused in one line; records
cut into frames under a small limit and joined back; every flipped byte of a mapping frame
caught.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest

from ckpt.stream.frames import FLAG_EPOCH, FLAG_MAPPING, FrameError, chunk_rows, decode_frame, encode_mapping_frame
from ckpt.stream.mapping import (
    KIND_DELTA,
    KIND_FULL,
    MAGIC,
    VERSION,
    MappingError,
    MappingRecord,
    decode_mapping,
    encode_mapping,
    full_nbytes,
    join_mapping,
    mapping_frames,
    record_for,
)
from sharding.managed_collision import FREE, PINNED_COUNT, McState, diff
from tests.unit.test_managed_collision import POLICIES, _evolve, _grow, _states

H = 2**40
META_OF = {"lfu": 0x1, "lru": 0x2, "distance_lfu": 0x3}  # the meta byte each policy's records carry


def _small() -> McState:
    """Shard 1 of a 13-row table over 2 ranks (slots 10..12), LFU: ids 5 and 7 held, the miss slot pinned."""
    raw = np.array([5, 7, FREE], dtype=np.int64)
    counts = np.array([1, 2, PINNED_COUNT], dtype=np.int64)
    return McState("mc.t", 10, raw, counts, None, 3, 2, np.array([5, 9]), None, 8, (0, 10, 13), H)


def _i64(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# --- the layout ----------------------------------------------------------------------------------


def test_a_full_record_is_laid_out_as_documented() -> None:
    s = _small()
    head = struct.pack("<4sHBB", b"DMC1", 1, KIND_FULL, 0x1)
    #               follows off size iter evict cap hash  nseg ev ad ctr hist keep
    fields = _i64(0, 10, 3, 3, 2, 8, H, 3, 0, 0, 0, 2, 0)
    want = head + fields + _i64(0, 10, 13) + _i64(5, 7, FREE) + _i64(1, 2, PINNED_COUNT) + _i64(5, 9)
    record = MappingRecord.of_state(s)
    assert encode_mapping(record) == want
    assert record.nbytes == full_nbytes(s) == len(want)
    assert decode_mapping("mc.t", want) == record
    assert MAGIC == b"DMC1" and VERSION == 1


def test_a_delta_record_is_laid_out_as_documented() -> None:
    old = _small()
    new = replace(
        old,
        raw_ids=np.array([5, 8, FREE]),
        counts=np.array([1, 1, PINNED_COUNT]),
        current_iter=4,
        history_ids=np.array([5, 9, 8]),
    )
    d = diff(old, new)
    assert d.history_keep == 2
    record = MappingRecord.of_delta(d, 7, old.segments, H)
    head = struct.pack("<4sHBB", b"DMC1", 1, KIND_DELTA, 0x1)
    #               follows off size iter evict cap hash  nseg ev ad ctr hist keep
    fields = _i64(7, 10, 3, 4, 2, 8, H, 3, 1, 1, 1, 1, 2)
    sections = _i64(0, 10, 13) + _i64(11) + _i64(7) + _i64(11) + _i64(8) + _i64(11) + _i64(1) + _i64(8)
    assert encode_mapping(record) == head + fields + sections
    assert record.nbytes == len(head + fields + sections)
    back = decode_mapping("mc.t", head + fields + sections)
    assert back == record and back.resolve(old, 7) == new


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_full_and_delta_records_round_trip_byte_exact(replay_seed, policy: str) -> None:
    rng = np.random.default_rng(replay_seed.value)
    for world in (1, 2, 3):
        for rank, first in enumerate(_states(rng, int(rng.integers(8, 60)), world, policy)):
            where = f"{replay_seed}: {policy} world {world} rank {rank}"
            chain = [first]
            for _ in range(8):
                chain.append((_grow if rng.random() < 0.5 else _evolve)(rng, chain[-1], world, rank))
            state = chain[0]
            for cid, (old, new) in enumerate(zip(chain, chain[1:]), start=1):
                for record in (MappingRecord.of_state(new), MappingRecord.of_delta(diff(old, new), cid, new.segments, H)):
                    data = encode_mapping(record)
                    assert data[7] == META_OF[policy], where
                    assert len(data) == record.nbytes, where
                    back = decode_mapping(new.table, data)
                    assert back == record, where
                    assert encode_mapping(back) == data, where
                    assert back.resolve(old, cid) == new, where
                    arrays = [back.state.raw_ids] if back.state is not None else [back.delta.evicted_slots]  # type: ignore[union-attr]
                    assert not any(a.flags.writeable for a in arrays), where
                state = decode_mapping(new.table, encode_mapping(record_for(state, new, cid))).resolve(state, cid)
            assert state == chain[-1], f"{where}: a chain of records replayed"


def test_a_delta_record_carries_the_kept_history_count() -> None:
    old = _small()
    new = replace(old, current_iter=4, history_ids=np.array([5, 9, 3, 3]))
    record = record_for(old, new, 5)
    assert not record.full and record.delta is not None and record.delta.history_keep == 2
    back = decode_mapping("mc.t", encode_mapping(record))
    assert back.delta is not None and (back.delta.history_keep, back.delta.history_ids.tolist()) == (2, [3, 3])
    assert back.resolve(old, 5) == new


# --- which record --------------------------------------------------------------------------------


def test_record_for_writes_the_smaller_record(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    (s,) = _states(rng, 400, 1, "distance_lfu")
    assert record_for(None, s, 3).full and record_for(s, s, 0).full  # nothing before it, a full checkpoint
    few = _grow(rng, s, 1, 0)  # no eviction: scalars and the history only
    small = record_for(s, few, 3)
    assert not small.full and small.follows == 3 and small.nbytes < full_nbytes(few), str(replay_seed)
    # every slot changed: the delta (tombstone, admission and counters per slot) outgrows the full record
    raw = s.raw_ids.copy()
    held = np.flatnonzero(raw[:-1] != FREE)
    raw[: s.size - 1] = np.arange(1, s.size) * 7  # routed to rank 0 of 1, never held before: ids 7, 14, ...
    assert held.size
    moved = replace(
        s,
        raw_ids=raw,
        counts=np.concatenate([np.full(s.size - 1, 3), [PINNED_COUNT]]),
        last_access=np.concatenate([np.full(s.size - 1, s.current_iter), s.last_access[-1:]]),  # type: ignore[index]
    )
    delta_bytes = MappingRecord.of_delta(diff(s, moved), 3, s.segments, H).nbytes
    chosen = record_for(s, moved, 3)
    assert delta_bytes > full_nbytes(moved) and chosen.full and chosen.follows == 0
    assert chosen.resolve(s, 3) == moved and chosen.resolve(None, 0) == moved


def test_a_record_applies_only_after_the_checkpoint_it_follows(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    (s,) = _states(rng, 30, 1, "lfu")
    new = _evolve(rng, s, 1, 0)
    record = MappingRecord.of_delta(diff(s, new), 4, s.segments, H)
    with pytest.raises(MappingError, match="a delta from checkpoint 4, but the chain has the state of checkpoint 3") as e:
        record.resolve(s, 3)
    assert "mc._embedding_module.embedding_bags.t" in _one_line(e)
    with pytest.raises(MappingError, match="but the chain has no state before it"):
        record.resolve(None, 4)
    if record.delta is not None and record.delta.evicted_slots.size:
        other = replace(s, raw_ids=np.where(s.raw_ids == FREE, FREE, s.raw_ids + 1))
        with pytest.raises(MappingError, match="does not apply: .*follows another checkpoint") as e:
            record.resolve(other, 4)
        _one_line(e)


def test_a_record_refuses_contents_that_do_not_make_one() -> None:
    s = _small()
    d = diff(s, s)
    with pytest.raises(MappingError, match="holds both a state and a delta"):
        MappingRecord("mc.t", 0, s.segments, H, state=s, delta=d)
    with pytest.raises(MappingError, match="holds neither"):
        MappingRecord("mc.t", 0, s.segments, H)
    with pytest.raises(MappingError, match="a full record follows no checkpoint"):
        MappingRecord("mc.t", 2, s.segments, H, state=s)
    with pytest.raises(MappingError, match="must name the checkpoint it follows"):
        MappingRecord.of_delta(d, 0, s.segments, H)
    with pytest.raises(MappingError, match=r"slots 10\.\.12 are no shard of segments \(0, 5, 13\)"):
        MappingRecord.of_delta(d, 1, (0, 5, 13), H)
    with pytest.raises(MappingError, match="its state is of table mc.t"):
        MappingRecord("other", 0, s.segments, H, state=s)
    with pytest.raises(MappingError, match="a shard of 0 slots"):
        MappingRecord.of_delta(replace(d, slot_offset=13, size=0), 1, (0, 10, 13, 13), H)


# --- refusals ------------------------------------------------------------------------------------


def _with_field(data: bytes, fmt: str, at: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def test_damaged_truncated_and_newer_records_are_refused_in_one_line(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    (s,) = _states(rng, 20, 1, "distance_lfu")
    full = encode_mapping(MappingRecord.of_state(s))
    delta = encode_mapping(MappingRecord.of_delta(diff(s, _evolve(rng, s, 1, 0)), 1, s.segments, H))
    table = s.table
    for data in (full, delta):
        for n in range(len(data)):
            with pytest.raises(MappingError, match=f"mapping record of table {table}: (truncated|bad magic)") as e:
                decode_mapping(table, data[:n])
            _one_line(e)
        with pytest.raises(MappingError, match="trailing bytes: its fields say") as e:
            decode_mapping(table, data + bytes(8))
        with pytest.raises(MappingError, match="bad magic") as e:
            decode_mapping(table, b"DMC2" + data[4:])
        with pytest.raises(MappingError, match="is version 2, written by a newer deltarec .*: upgrade") as e:
            decode_mapping(table, _with_field(data, "<H", 4, 2))
        assert table in _one_line(e)
        with pytest.raises(MappingError, match="unknown version 0"):
            decode_mapping(table, _with_field(data, "<H", 4, 0))
        with pytest.raises(MappingError, match="unknown kind 3"):
            decode_mapping(table, _with_field(data, "<B", 6, 3))
        with pytest.raises(MappingError, match="metadata bits 0x7"):
            decode_mapping(table, _with_field(data, "<B", 7, 7))
        with pytest.raises(MappingError, match="negative counts"):
            decode_mapping(table, _with_field(data, "<q", 8 + 8 * 11, -1))  # n_history
    with pytest.raises(MappingError, match="a full record with delta fields"):
        decode_mapping(table, _with_field(full, "<q", 8, 5))  # follows
    small = encode_mapping(MappingRecord.of_state(_small()))  # two history ids
    with pytest.raises(MappingError, match="inconsistent: .*exceed the capacity"):
        decode_mapping(table, _with_field(small, "<q", 8 + 8 * 5, 1))  # history_capacity 1
    with pytest.raises(MappingError, match="delta record must name the checkpoint"):
        decode_mapping(table, _with_field(delta, "<q", 8, 0))


def test_every_flip_of_a_structural_field_is_refused() -> None:
    """A flipped bit in a value (an id, a counter) is the frames' CRC's to catch; one in the
    magic, version, kind, metadata bits, the checkpoint followed, the shard's place or any
    count is refused by the decoding or by the replay of the record onto the state it follows."""
    prev = _small()
    grown = replace(prev, history_ids=np.array([5, 9, 1]))
    for record in (MappingRecord.of_state(prev), record_for(prev, grown, 2)):
        data = encode_mapping(record)
        assert decode_mapping("mc.t", data).resolve(prev, 2) == (prev if record.full else grown)
        structural = [*range(32), *range(64, 112)]  # header, follows, slot_offset, size; the counts and history_keep
        for at in structural:
            for bit in (0x01, 0x10, 0x80):
                bad = bytearray(data)
                bad[at] ^= bit
                with pytest.raises(MappingError) as e:
                    decode_mapping("mc.t", bytes(bad)).resolve(prev, 2)
                _one_line(e)


# --- frames --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_frame_bytes", [160, 256, 1000, 1 << 20])
def test_a_record_cut_into_frames_under_the_limit_joins_back(replay_seed, max_frame_bytes: int) -> None:
    rng = np.random.default_rng(replay_seed.value)
    for policy in POLICIES:
        s = _states(rng, int(rng.integers(20, 120)), 2, policy)[1]
        for record in (MappingRecord.of_state(s), record_for(s, _grow(rng, s, 2, 1), 6)):
            data = encode_mapping(record)
            encoded = list(mapping_frames(record, run_id="r", checkpoint_id=7, rank=1, max_frame_bytes=max_frame_bytes, epoch=3))
            where = f"{replay_seed}: {policy}, {len(data)} bytes under {max_frame_bytes}"
            assert all(len(f.data) <= max_frame_bytes for f in encoded), where
            assert [(f.row_count, f.first_row, f.last_row) for f in encoded] == [
                (0, s.slot_offset, s.slot_offset + s.size - 1)
            ] * len(encoded), where
            frames = [decode_frame(f.data) for f in encoded]
            assert all(f.is_mapping and f.row_count == 0 and f.epoch == 3 and f.encoding == VERSION for f in frames), where
            assert [(f.chunk_index, f.chunk_count) for f in frames] == [(i, len(frames)) for i in range(len(frames))], where
            assert all(f.mapping is not None and f.mapping.nbytes % 8 == 0 for f in frames[:-1]), where
            assert b"".join(bytes(f.mapping) for f in frames if f.mapping is not None) == data, where
            assert join_mapping(frames) == record, where
            whole = encode_mapping_frame(
                run_id="r", checkpoint_id=7, rank=1, table=s.table, piece=data, encoding=VERSION, epoch=3
            )
            assert (len(frames) > 1) == (len(whole) > max_frame_bytes), where  # cut only when one frame would not fit
            if len(frames) > 1:
                # each piece but the last is as large as the limit allows: 8 bytes more would not fit
                assert len(encoded[0].data) + 8 > max_frame_bytes, where


def test_joining_refuses_frames_that_are_not_one_whole_record() -> None:
    record = MappingRecord.of_state(replace(_small(), history_capacity=64, history_ids=np.arange(40) * 3))
    frames = [decode_frame(f.data) for f in mapping_frames(record, run_id="r", checkpoint_id=7, rank=1, max_frame_bytes=160)]
    n = len(frames)
    assert n >= 3
    cases = {
        f"frame 0 is chunk 0 of {n}, expected 0 of {n - 1}": [frames[0], *frames[2:]],  # one missing
        f"frame 0 is chunk 1 of {n}, expected 0 of {n}": frames[1:] + frames[:1],  # out of order
        f"frame 0 is chunk 0 of {n}, expected 0 of {n + 1}": [frames[0], *frames],  # doubled
    }
    for message, given in cases.items():
        with pytest.raises(MappingError, match=f"mapping frames of table mc.t: {message}") as e:
            join_mapping(given)
        _one_line(e)
    other = [decode_frame(f.data) for f in mapping_frames(record, run_id="r", checkpoint_id=8, rank=1, max_frame_bytes=160)]
    with pytest.raises(MappingError, match="is of another record"):
        join_mapping([frames[0], other[1], *frames[2:]])
    rows = decode_frame(next(chunk_rows(run_id="r", checkpoint_id=7, rank=1, table="mc.t", col_offset=0, dim=2, encoding=1,
                                        row_ids=np.arange(3), payload=np.zeros((3, 2), np.float32))).data)  # fmt: skip
    with pytest.raises(MappingError, match="frame 0 holds rows of table mc.t"):
        join_mapping([rows])
    with pytest.raises(MappingError, match="no mapping frames"):
        join_mapping([])
    newer = [replace(f, encoding=VERSION + 1) for f in frames]
    with pytest.raises(MappingError, match="record of version 2, written by a newer deltarec .*: upgrade") as e:
        join_mapping(newer)
    _one_line(e)


def test_every_single_byte_flip_of_a_mapping_frame_is_caught() -> None:
    record = record_for(_small(), replace(_small(), history_ids=np.array([5, 9, 1])), 2)
    (data,) = [f.data for f in mapping_frames(record, run_id="r", checkpoint_id=2, rank=1, epoch=5)]
    header_len = struct.unpack_from("<I", data, 8)[0]
    assert struct.unpack_from("<H", data, 6)[0] == FLAG_MAPPING | FLAG_EPOCH
    assert data[header_len : header_len + record.nbytes] == encode_mapping(record)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        with pytest.raises(FrameError) as e:
            decode_frame(bytes(bad))
        if 20 <= i:  # past the prefix (magic, version, flags, lengths): the CRC says it
            assert "CRC mismatch" in str(e.value), i
    # and the CRC is the one rows frames use
    assert struct.unpack_from("<I", data, len(data) - 4)[0] == zlib.crc32(data[:-4])
