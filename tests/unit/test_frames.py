import struct
import zlib

import pytest
import torch

from ckpt.stream.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_EPOCH,
    FLAG_MAPPING,
    FLAG_ROW_BITMAP,
    FLAG_ROW_RUN,
    MAGIC,
    VERSION,
    Frame,
    FrameError,
    OptimState,
    chunk_mapping,
    chunk_rows,
    decode_frame,
    encode_frame,
    encode_mapping_frame,
    file_where,
    kafka_where,
)

META = dict(run_id="run-7", checkpoint_id=42, rank=3, table="t_cat_0", col_offset=32, dim=16, encoding=0)


def _rows(n: int, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(10 * n + 1, generator=g)[:n].to(torch.int64) * 1_000_003  # > 2**32
    return ids, torch.randn(n, dim, generator=g), torch.rand(n, generator=g)


def _optim(f: Frame) -> dict[str, torch.Tensor]:
    return {o.name: o.rows for o in f.optim}


def _frame(n: int = 5, **over) -> bytes:
    ids, rows, mom = _rows(n)
    kw = dict(META, row_ids=ids, payload=rows, optim=[OptimState("momentum1", 0, mom)])
    kw.update(over)
    return encode_frame(**kw)


def test_round_trip_all_fields_and_tensors():
    ids, rows, mom = _rows(7)
    half = rows.to(torch.float16)
    m2 = torch.arange(7 * 3, dtype=torch.int16).view(7, 3)
    buf = encode_frame(
        **dict(META, encoding=1),
        row_ids=ids,
        payload=half,
        optim=[OptimState("momentum1", 0, mom), OptimState("m2", 9, m2)],
        chunk_index=2,
        chunk_count=5,
    )
    f = decode_frame(buf)
    assert isinstance(f, Frame)
    assert (f.run_id, f.checkpoint_id, f.rank, f.table, f.col_offset, f.dim, f.encoding) == ("run-7", 42, 3, "t_cat_0", 32, 16, 1)
    assert (f.chunk_index, f.chunk_count, f.row_count, f.row_bytes) == (2, 5, 7, 32)
    assert f.row_ids.dtype == torch.int64 and torch.equal(f.row_ids, ids)
    assert f.payload.shape == (7, 32) and f.payload.dtype == torch.uint8
    assert torch.equal(f.payload.view(torch.float16), half)
    assert [(o.name, o.encoding, o.row_bytes) for o in f.optim] == [("momentum1", 0, 4), ("m2", 9, 6)]
    assert torch.equal(_optim(f)["momentum1"].view(torch.float32).view(-1), mom)
    assert torch.equal(_optim(f)["m2"].view(torch.int16), m2)


def test_decoded_tensors_are_views_of_the_buffer():
    ids, rows, _ = _rows(4)
    buf = bytearray(encode_frame(**META, row_ids=ids, payload=rows))
    f = decode_frame(buf)
    before = f.payload[0, 0].item()
    at = bytes(buf).index(rows[0].numpy().tobytes())
    buf[at] ^= 0xFF  # change the buffer: the tensor sees it
    assert f.payload[0, 0].item() == before ^ 0xFF


def test_unaligned_buffer_still_decodes():
    buf = _frame()
    f = decode_frame(memoryview(b"x" + buf)[1:])
    assert torch.equal(f.row_ids, decode_frame(buf).row_ids)


def test_empty_frame_round_trips():
    f = decode_frame(_frame(0))
    assert f.row_count == 0 and f.payload.shape == (0, 64) and f.optim[0].rows.shape == (0, 4)


def test_every_single_byte_flip_is_detected():
    buf = _frame(3)
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= 0x5A
        with pytest.raises(FrameError):
            decode_frame(bytes(bad))


def test_flip_in_a_large_frame_is_a_crc_error():
    buf = _frame(2000)
    for i in (len(buf) // 3, len(buf) // 2, len(buf) - 5):
        bad = bytearray(buf)
        bad[i] ^= 1
        with pytest.raises(FrameError, match="CRC mismatch"):
            decode_frame(bad)


def test_truncated_and_trailing_bytes():
    buf = _frame(3)
    for n in range(len(buf)):
        with pytest.raises(FrameError):
            decode_frame(buf[:n])
    with pytest.raises(FrameError, match="truncated: frame says"):
        decode_frame(buf[:-1])
    with pytest.raises(FrameError, match="trailing bytes"):
        decode_frame(buf + b"\0")


def _reseal(buf: bytes) -> bytes:
    body = buf[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_wrong_magic_and_version():
    buf = _frame()
    with pytest.raises(FrameError, match="bad magic"):
        decode_frame(b"XXXX" + buf[4:])
    v2 = _reseal(buf[:4] + struct.pack("<H", VERSION + 1) + buf[6:])
    with pytest.raises(FrameError, match=f"unsupported frame version {VERSION + 1}"):
        decode_frame(v2)
    assert decode_frame(_reseal(buf)).checkpoint_id == 42  # the helper itself is sound


def test_inconsistent_header_with_valid_crc_is_rejected():
    buf = _frame(3)
    # row_count field (after prefix 20 bytes + ckpt 8 + rank 4 + col 4) claims 4 rows
    at = 20 + 16
    forged = _reseal(buf[:at] + struct.pack("<I", 4) + buf[at + 4 :])
    with pytest.raises(FrameError, match="body length mismatch"):
        decode_frame(forged)


def test_error_location_is_added_by_the_caller():
    bad = b"XXXX" + _frame()[4:]
    with pytest.raises(FrameError) as e:
        decode_frame(bad, where=kafka_where("r.rows.g0", 1, 17))
    assert str(e.value).startswith("topic r.rows.g0 partition 1 offset 17: bad magic")
    assert e.value.reason.startswith("bad magic") and e.value.where == "topic r.rows.g0 partition 1 offset 17"
    try:
        decode_frame(bad)
    except FrameError as plain:
        located = plain.located(file_where("/x/0.seg", 4096))
    assert str(located).startswith("/x/0.seg at byte 4096: bad magic")


def test_encode_rejects_inconsistent_inputs():
    ids, rows, mom = _rows(5)
    with pytest.raises(ValueError, match="payload"):
        encode_frame(**META, row_ids=ids, payload=rows[:4])
    with pytest.raises(ValueError, match="optimizer state 'm'"):
        encode_frame(**META, row_ids=ids, payload=rows, optim=[OptimState("m", 0, mom[:3])])
    with pytest.raises(ValueError, match="chunk_index"):
        encode_frame(**META, row_ids=ids, payload=rows, chunk_index=1, chunk_count=1)
    with pytest.raises(ValueError, match="out of range"):
        encode_frame(**dict(META, rank=-1), row_ids=ids, payload=rows)


@pytest.mark.parametrize(
    "n,dim,max_bytes",
    [
        (1, 16, 4096),
        (100, 16, 4096),
        (1000, 64, 20_000),
        (5000, 128, DEFAULT_MAX_FRAME_BYTES),
        (333, 3, 1000),
    ],
)
def test_chunking_respects_limit_and_covers_rows_once(n, dim, max_bytes, replay_seed):
    ids, rows, mom = _rows(n, dim)
    mom2 = torch.randn(n, 2, dtype=torch.float64, generator=replay_seed.torch_generator())
    optim = [OptimState("momentum1", 0, mom), OptimState("m2", 0, mom2)]
    frames = list(chunk_rows(**dict(META, dim=dim), row_ids=ids, payload=rows, optim=optim, max_frame_bytes=max_bytes))
    assert frames and all(len(f.data) <= max_bytes for f in frames)
    dec = [decode_frame(f.data) for f in frames]
    assert [f.chunk_index for f in dec] == list(range(len(dec)))
    assert {f.chunk_count for f in dec} == {len(dec)}
    assert torch.equal(torch.cat([f.row_ids for f in dec]), ids)
    assert torch.equal(torch.cat([f.payload for f in dec]).view(torch.float32), rows)
    assert torch.equal(torch.cat([_optim(f)["m2"] for f in dec]).view(torch.float64), mom2), str(replay_seed)
    # What the writer indexes comes with each frame and agrees with the frame itself.
    assert [(e.row_count, e.first_row, e.last_row) for e in frames] == [
        (f.row_count, int(f.row_ids[0]), int(f.row_ids[-1])) for f in dec
    ]
    # Frames are as full as the limit allows: one more row would not have fit.
    per = dec[0].row_count
    if len(dec) > 1:
        one_more = encode_frame(
            **dict(META, dim=dim),
            row_ids=ids[: per + 1],
            payload=rows[: per + 1],
            optim=[OptimState(o.name, o.encoding, o.rows[: per + 1]) for o in optim],
        )
        assert len(one_more) > max_bytes


def test_chunking_edge_cases():
    ids, rows, _ = _rows(3)
    assert list(chunk_rows(**META, row_ids=ids[:0], payload=rows[:0])) == []
    with pytest.raises(ValueError, match="more than max_frame_bytes"):
        chunk_rows(**META, row_ids=ids, payload=rows, max_frame_bytes=100)  # refused at the call, before any frame
    assert MAGIC == b"DRF1"


def test_a_run_of_rows_stores_only_its_first_id_and_decodes_to_the_run():
    n, first = 300, 5_000_000_123
    ids = torch.arange(first, first + n, dtype=torch.int64)
    rows = torch.randn(n, 16)
    run = encode_frame(**META, row_ids=ids, payload=rows)
    scattered = encode_frame(**META, row_ids=ids.flip(0), payload=rows)
    assert struct.unpack_from("<H", run, 6)[0] == 1 and struct.unpack_from("<H", scattered, 6)[0] == 0
    assert len(scattered) - len(run) == 8 * (n - 1)
    f = decode_frame(run)
    assert torch.equal(f.row_ids, ids) and torch.equal(f.payload.view(torch.float32), rows)


def test_chunks_of_a_run_hold_more_rows_and_each_is_a_run():
    n, dim = 5000, 16
    ids = torch.arange(100, 100 + n, dtype=torch.int64)
    rows = torch.randn(n, dim)
    run = list(chunk_rows(**META, row_ids=ids, payload=rows, max_frame_bytes=20_000))
    gappy = ids.clone()
    gappy[-1] += 1  # not a run any more
    other = list(chunk_rows(**META, row_ids=gappy, payload=rows, max_frame_bytes=20_000))
    assert run[0].row_count > other[0].row_count and all(len(f.data) <= 20_000 for f in run)
    got = torch.cat([decode_frame(f.data).row_ids for f in run])
    assert torch.equal(got, ids)


def _with_flags(buf: bytes, flags: int) -> bytes:
    out = bytearray(buf)
    struct.pack_into("<H", out, 6, flags)
    struct.pack_into("<I", out, len(out) - 4, zlib.crc32(bytes(out[:-4])))
    return bytes(out)


def test_an_unknown_flag_bit_is_refused():
    with pytest.raises(FrameError, match="unknown flags 0x10"):
        decode_frame(_with_flags(_frame(), 0x10))
    # bit 3 marks a mapping frame: set on a frame of rows, the rows say it is not one
    with pytest.raises(FrameError, match="mapping frame with column offset 32, 5 rows, dim 16 and 1 optimizer states"):
        decode_frame(_with_flags(_frame(), 0x8))


def test_the_writer_epoch_round_trips_and_old_frames_are_epoch_0():
    ids = torch.arange(5, 9)
    rows = torch.randn(4, 4)
    assert decode_frame(encode_frame(**META, row_ids=ids, payload=rows)).epoch == 0
    with_epoch = encode_frame(**META, row_ids=ids, payload=rows, epoch=7)
    back = decode_frame(with_epoch)
    assert back.epoch == 7 and torch.equal(back.payload.view(torch.float32), rows)
    frames = list(chunk_rows(**META, row_ids=torch.arange(100), payload=torch.randn(100, 4), epoch=3, max_frame_bytes=600))
    assert len(frames) > 1 and {decode_frame(f.data).epoch for f in frames} == {3}
    # the flag without its field: the header ends too early
    buf = bytearray(encode_frame(**META, row_ids=ids, payload=rows))
    struct.pack_into("<H", buf, 6, struct.unpack_from("<H", buf, 6)[0] | 0x2)
    struct.pack_into("<I", buf, len(buf) - 4, zlib.crc32(bytes(buf[:-4])))
    with pytest.raises(FrameError, match="epoch|header length"):
        decode_frame(bytes(buf))


def _flags(buf: bytes) -> int:
    return struct.unpack_from("<H", buf, 6)[0]


def test_scattered_ascending_rows_pack_as_a_bitmap_when_that_is_smaller():
    ids = torch.arange(0, 3000, 3, dtype=torch.int64) + 7_000_000_000  # every third row: 3 bits a row, not 64
    n, span = ids.numel(), 2998
    rows = torch.randn(n, 4)
    bitmap = encode_frame(**META, row_ids=ids, payload=rows)
    explicit = encode_frame(**META, row_ids=ids.flip(0), payload=rows.flip(0))  # not ascending: ids as given
    assert _flags(bitmap) == 0x4 and _flags(explicit) == 0
    ids_len = 16 + (span + 7) // 8
    assert len(explicit) - len(bitmap) == 8 * n - (ids_len + -ids_len % 8)
    f = decode_frame(bitmap)
    assert torch.equal(f.row_ids, ids) and torch.equal(f.payload.view(torch.float32), rows) and f.first_row is None
    assert _flags(encode_frame(**META, row_ids=torch.tensor([0, 10**6]), payload=torch.randn(2, 4))) == 0  # too sparse
    sparse = torch.arange(0, 50 * 400, 50, dtype=torch.int64)  # one row in 50: still under 8 bytes a row
    back = decode_frame(encode_frame(**META, row_ids=sparse, payload=torch.randn(400, 4)))
    assert torch.equal(back.row_ids, sparse)
    frames = list(chunk_rows(**META, row_ids=ids, payload=rows, max_frame_bytes=4000))
    assert len(frames) > 1 and all(len(fr.data) <= 4000 and _flags(fr.data) == 0x4 for fr in frames)
    assert torch.equal(torch.cat([decode_frame(fr.data).row_ids for fr in frames]), ids)
    # a bitmap naming another number of rows than the frame holds (a valid CRC): refused
    buf = bytearray(bitmap)
    header_len = struct.unpack_from("<I", buf, 8)[0]
    buf[header_len + 16] ^= 0x02
    struct.pack_into("<I", buf, len(buf) - 4, zlib.crc32(bytes(buf[:-4])))
    with pytest.raises(FrameError, match="row bitmap names 1001 rows"):
        decode_frame(bytes(buf))


# --- mapping frames (FLAG_MAPPING): a piece of a managed-collision mapping record, no rows ------


MAPPING = dict(run_id="run-7", checkpoint_id=42, rank=3, table="mc.t")


def test_a_mapping_frame_round_trips_its_piece_and_holds_no_rows():
    piece = bytes(range(256)) * 3 + b"tail"  # not a multiple of 8: padded
    buf = encode_mapping_frame(**MAPPING, piece=piece, encoding=1, chunk_index=1, chunk_count=3, epoch=9)
    assert _flags(buf) == FLAG_MAPPING | FLAG_EPOCH
    header_len = struct.unpack_from("<I", buf, 8)[0]
    assert len(buf) == header_len + len(piece) + (-len(piece) % 8) + 4
    f = decode_frame(buf)
    assert f.is_mapping and f.mapping is not None and bytes(f.mapping) == piece and f.mapping.readonly
    assert (f.run_id, f.checkpoint_id, f.rank, f.table, f.col_offset, f.dim, f.encoding) == ("run-7", 42, 3, "mc.t", 0, 0, 1)
    assert (f.chunk_index, f.chunk_count, f.epoch, f.row_bytes, f.row_count, f.first_row) == (1, 3, 9, len(piece), 0, None)
    assert f.row_ids.shape == (0,) and f.payload.shape == (0, 0) and f.optim == ()
    assert _flags(encode_mapping_frame(**MAPPING, piece=piece, encoding=1)) == FLAG_MAPPING
    assert decode_frame(encode_mapping_frame(**MAPPING, piece=piece, encoding=1)).epoch == 0
    assert not decode_frame(_frame()).is_mapping and decode_frame(_frame()).mapping is None  # frames of rows as they were


def test_every_single_byte_flip_of_a_mapping_frame_is_detected():
    buf = encode_mapping_frame(**MAPPING, piece=b"DMC1" + bytes(range(60)), encoding=1, epoch=2)
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= 0x5A
        with pytest.raises(FrameError):
            decode_frame(bytes(bad))
    for n in range(len(buf)):
        with pytest.raises(FrameError):
            decode_frame(buf[:n])


def test_a_mapping_frame_with_rows_or_a_row_encoding_flag_is_refused():
    buf = encode_mapping_frame(**MAPPING, piece=bytes(24), encoding=1)
    for flags in (FLAG_MAPPING | FLAG_ROW_RUN, FLAG_MAPPING | FLAG_ROW_BITMAP):
        with pytest.raises(FrameError, match=f"flags {flags:#x}: a mapping frame has no row ids"):
            decode_frame(_with_flags(buf, flags))
    for field, at in (("column offset 7", 20 + 12), ("7 rows", 20 + 16), ("dim 7", 20 + 20)):
        forged = bytearray(buf)
        struct.pack_into("<I", forged, at, 7)
        with pytest.raises(FrameError, match=field):
            decode_frame(_reseal(bytes(forged)))
    forged = bytearray(buf)
    struct.pack_into("<I", forged, 20 + 24, 16)  # row_bytes: a piece of 16 bytes in a frame sized for 24
    with pytest.raises(FrameError, match="body length mismatch: a mapping piece of 16 bytes"):
        decode_frame(_reseal(bytes(forged)))
    with pytest.raises(FrameError, match="the epoch|header length"):
        decode_frame(_with_flags(buf, FLAG_MAPPING | FLAG_EPOCH))
    with pytest.raises(ValueError, match="empty piece"):
        encode_mapping_frame(**MAPPING, piece=b"", encoding=1)
    with pytest.raises(ValueError, match="chunk_index"):
        encode_mapping_frame(**MAPPING, piece=b"x", encoding=1, chunk_index=2, chunk_count=2)


@pytest.mark.parametrize("max_bytes", [96, 100, 200, 4096])
def test_a_mapping_record_is_cut_under_the_limit_and_joins_back(max_bytes, replay_seed):
    rng = replay_seed.rng()
    record = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))
    frames = list(
        chunk_mapping(**MAPPING, record=record, encoding=1, first_row=100, last_row=149, max_frame_bytes=max_bytes, epoch=4)
    )
    where = f"{replay_seed}: {len(record)} bytes under {max_bytes}"
    assert frames and all(len(f.data) <= max_bytes for f in frames), where
    assert {(f.row_count, f.first_row, f.last_row) for f in frames} == {(0, 100, 149)}, where
    dec = [decode_frame(f.data) for f in frames]
    assert [(f.chunk_index, f.chunk_count) for f in dec] == [(i, len(dec)) for i in range(len(dec))], where
    assert b"".join(bytes(f.mapping) for f in dec if f.mapping is not None) == record, where
    assert all(f.mapping is not None and f.mapping.nbytes % 8 == 0 for f in dec[:-1]), where
    if len(dec) > 1:  # pieces are as large as fit: 8 bytes more would not
        assert len(frames[0].data) + 8 > max_bytes, where


def test_mapping_chunking_edge_cases():
    with pytest.raises(ValueError, match="more than max_frame_bytes=80"):
        chunk_mapping(**MAPPING, record=b"x" * 100, encoding=1, first_row=0, last_row=9, max_frame_bytes=80)  # at the call
    with pytest.raises(ValueError, match="empty mapping record"):
        chunk_mapping(**MAPPING, record=b"", encoding=1, first_row=0, last_row=9)
    (one,) = chunk_mapping(**MAPPING, record=b"x" * 100, encoding=1, first_row=0, last_row=9)
    assert decode_frame(one.data).chunk_count == 1
