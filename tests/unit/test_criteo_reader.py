"""Tests of the Criteo TSV reader: exact decoding, the split between ranks, wrap-around,
exact resume, and malformed-line handling with correct ``file:line`` positions."""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from trainer.data.criteo import CriteoTsvReader, MalformedLineError, diagnose_line
from trainer.data.reader import Batch, Reader

NAMES = [f"C{i}" for i in range(1, 27)]
MARKER_TABLE = 2**32  # C1 carries the line's marker; a table this big keeps it exact
SIZES = [MARKER_TABLE] + [1000 + 7 * i for i in range(25)]


def line(label: object = 1, dense: list | None = None, cats: list | None = None) -> str:
    """One TSV record; ``None`` fields are written empty."""
    dense = dense if dense is not None else [1] * 13
    cats = cats if cats is not None else ["0a"] * 26
    fields = [str(label)] + ["" if v is None else str(v) for v in dense]
    fields += ["" if c is None else str(c) for c in cats]
    return "\t".join(fields)


def marked(marker: int, label: int = 0, width: int = 0) -> str:
    """A valid record whose C1 holds ``marker``; ``width`` pads C26 to vary line length."""
    cats = [f"{marker:x}"] + ["1f"] * 24 + ["f" * max(1, min(width, 16))]
    return line(label, [marker % 50] + [None] * 12, cats)


def write(path: Path, lines: list[str], newline: str = "\n", trailing: bool = True) -> str:
    """Write ``lines`` with the given newline, with or without a final newline."""
    text = newline.join(lines) + (newline if trailing and lines else "")
    path.write_bytes(text.encode())
    return str(path)


def reader(paths: list[str] | None = None, **overrides: object) -> CriteoTsvReader:
    """A reader over ``paths``; keyword overrides replace the defaults."""
    kwargs: dict[str, object] = dict(paths=paths, feature_names=NAMES, num_embeddings=SIZES, batch_size=4, rank=0, world_size=1)
    kwargs.update(overrides)
    return CriteoTsvReader(**kwargs)  # type: ignore[arg-type]


def markers(batch: Batch) -> list[int]:
    """The C1 marker of each sample of a batch (all test lines have a C1)."""
    jt = batch.sparse_features["C1"]
    assert jt.lengths().tolist() == [1] * len(batch.labels)
    return jt.values().tolist()


def assert_batches_equal(a: Batch, b: Batch) -> None:
    """Exact equality of every tensor of two batches."""
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def read_one_epoch(r: CriteoTsvReader) -> list[int]:
    """Markers of every line the reader yields until it starts its next epoch (batch 1)."""
    assert r.batch_size == 1
    seen = []
    while True:
        seen += markers(r.next_batch())
        if r.state_dict()["epoch"] == 1:
            return seen


# -- decoding ------------------------------------------------------------------------------


def test_decodes_values_exactly(tmp_path: Path) -> None:
    dense_a = [0, 5, -3, None, 123456789012, 1, 2, 3, 4, 5, 6, 7, 99]
    cats_a = ["ffffffff", None, "0A", "abcdef0123456789"] + [f"{i:x}" for i in range(22)]
    dense_b = [None] * 13
    cats_b = [None] * 26
    path = write(tmp_path / "a.tsv", [line(1, dense_a, cats_a), line(0, dense_b, cats_b)], newline="\r\n")
    batch = reader([path], batch_size=2).next_batch()
    assert isinstance(batch, Batch)
    assert batch.labels.dtype == torch.float32 and batch.labels.tolist() == [1.0, 0.0]
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (2, 13)
    want = [np.float32(math.log1p(max(x or 0, 0))) for x in dense_a]
    assert batch.dense_features[0].numpy().tolist() == want
    assert batch.dense_features[1].abs().sum() == 0  # empty dense -> 0 -> log1p(0)
    kjt = batch.sparse_features
    assert kjt.keys() == NAMES and kjt.values().dtype == torch.int64
    for j, (name, size) in enumerate(zip(NAMES, SIZES)):
        jt = kjt[name]
        expected = [] if cats_a[j] is None else [int(cats_a[j], 16) % size]
        assert jt.lengths().tolist() == [len(expected), 0]  # sample b has only empty bags
        assert jt.values().tolist() == expected


def test_is_a_reader(tmp_path: Path) -> None:
    assert isinstance(reader([write(tmp_path / "a.tsv", [line()])]), Reader)


def test_files_crlf_and_missing_trailing_newline_are_one_sequence(tmp_path: Path) -> None:
    paths = [
        write(tmp_path / "a.tsv", [marked(i) for i in range(0, 3)], newline="\r\n"),
        write(tmp_path / "empty.tsv", []),
        write(tmp_path / "b.tsv", [marked(i) for i in range(3, 5)], trailing=False),
        write(tmp_path / "c.tsv", [marked(i) for i in range(5, 9)], newline="\r\n", trailing=False),
    ]
    r = reader(paths, batch_size=3)
    got = [markers(r.next_batch()) for _ in range(4)]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]  # the last batch wrapped


def test_wraps_around_with_batches_spanning_the_wrap(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "a.tsv", [marked(i) for i in range(5)])
    r = reader([path], batch_size=3)
    with caplog.at_level(logging.INFO, logger="trainer.data.criteo"):
        assert markers(r.next_batch()) == [0, 1, 2]
        assert r.state_dict()["epoch"] == 0
        assert markers(r.next_batch()) == [3, 4, 0]
        assert r.state_dict()["epoch"] == 1
        assert markers(r.next_batch()) == [1, 2, 3]
        assert markers(r.next_batch()) == [4, 0, 1]
    assert r.state_dict()["epoch"] == 2
    wraps = [rec for rec in caplog.records if "starting epoch" in rec.getMessage()]
    assert len(wraps) == 2


def test_batch_larger_than_the_range_wraps_several_times(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tsv", [marked(i) for i in range(2)])
    r = reader([path], batch_size=5)
    assert markers(r.next_batch()) == [0, 1, 0, 1, 0]
    assert r.state_dict()["epoch"] == 2


# -- ranks ---------------------------------------------------------------------------------


def test_two_ranks_cover_every_line_once_per_epoch(tmp_path: Path) -> None:
    paths = [
        write(tmp_path / "a.tsv", [marked(i, width=i % 17) for i in range(0, 7)]),
        write(tmp_path / "b.tsv", [marked(i, width=i % 5) for i in range(7, 20)], trailing=False),
    ]
    seen = [read_one_epoch(reader(paths, batch_size=1, rank=r, world_size=2)) for r in range(2)]
    assert seen[0] and seen[1]
    assert seen[0] + seen[1] == list(range(20))  # each rank reads a contiguous run, in order


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    files=st.lists(
        st.tuples(
            st.lists(st.integers(0, 16), max_size=6),  # line widths
            st.booleans(),  # trailing newline
            st.booleans(),  # CRLF
        ),
        min_size=1,
        max_size=4,
    ),
    world_size=st.integers(1, 5),
)
def test_ranks_partition_any_input(files: list[tuple[list[int], bool, bool]], world_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths, marker = [], 0
        for i, (widths, trailing, crlf) in enumerate(files):
            lines = [marked(marker + k, width=w) for k, w in enumerate(widths)]
            marker += len(widths)
            newline = "\r\n" if crlf else "\n"
            paths.append(write(Path(tmp) / f"{i}.tsv", lines, newline=newline, trailing=trailing))
        try:
            readers = [reader(paths, batch_size=1, rank=r, world_size=world_size) for r in range(world_size)]
        except ValueError as error:
            assert "too few lines" in str(error) or "empty" in str(error)
            assert marker < 2 * world_size  # only tiny inputs may fail
            return
        seen = [read_one_epoch(r) for r in readers]
        assert all(seen)
        assert [m for part in seen for m in part] == list(range(marker))


def test_too_few_lines_for_world_size(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tsv", [marked(0), marked(1)])
    reader([path], rank=1, world_size=2)  # two lines suffice for two ranks
    with pytest.raises(ValueError, match="too few lines"):
        reader([path], rank=0, world_size=3)
    with pytest.raises(ValueError, match="empty"):
        reader([write(tmp_path / "e.tsv", [])])


# -- state ---------------------------------------------------------------------------------


def test_state_restore_yields_identical_batches(tmp_path: Path) -> None:
    paths = [
        write(tmp_path / "a.tsv", [marked(i, width=i % 9) for i in range(0, 20)], newline="\r\n"),
        write(tmp_path / "b.tsv", [marked(i, width=i % 4) for i in range(20, 31)], trailing=False),
    ]
    original = reader(paths, batch_size=5, rank=1, world_size=2)
    states, batches = [], []
    for _ in range(12):  # several wraps and file crossings
        states.append(json.loads(json.dumps(original.state_dict())))
        batches.append(original.next_batch())
    assert states[-1]["epoch"] >= 2
    assert len({s["file_index"] for s in states}) == 2
    for start in (0, 3, 7, 11):
        restored = reader(paths, batch_size=5, rank=1, world_size=2)
        restored.next_batch()  # elsewhere first: load must seek, not just continue
        restored.load_state_dict(states[start])
        for want in batches[start:]:
            assert_batches_equal(restored.next_batch(), want)
        assert restored.state_dict() == original.state_dict()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: s.pop("epoch"), "epoch"),
        (lambda s: s.update(extra=1), "extra"),
        (lambda s: s.update(byte_offset="7"), "byte_offset"),
        (lambda s: s.update(file_index=1.0), "file_index"),
        (lambda s: s.update(skipped_lines=True), "skipped_lines"),
        (lambda s: s.update(epoch=-1), "epoch"),
        (lambda s: s.update(file_index=5), "outside"),
        (lambda s: s.update(byte_offset=0), "outside"),  # rank 0's first line
        (lambda s: s.update(byte_offset=s["byte_offset"] + 3), "not the start of a line"),
    ],
)
def test_bad_state_is_rejected(tmp_path: Path, change: object, named: str) -> None:
    path = write(tmp_path / "a.tsv", [marked(i) for i in range(10)])
    r = reader([path], rank=1, world_size=2)
    state = r.state_dict()
    assert state["byte_offset"] > 0
    change(state)  # type: ignore[operator]
    with pytest.raises(ValueError, match=named):
        r.load_state_dict(state)
    assert markers(r.next_batch()) == [5, 6, 7, 8]  # the position did not move


# -- malformed lines -----------------------------------------------------------------------

BAD_LINES = [
    (line(1) + "\textra", "expected 40 tab-separated fields, found 41"),
    ("", "empty line"),
    (line(2), "label must be 0 or 1"),
    (line("x"), "label is not an integer"),
    (line(1, [1.5] + [1] * 12), "dense field I1"),
    (line(1, [1] * 12 + ["-"]), "dense field I13"),
    (line(1, cats=["0a"] * 25 + ["zz"]), "categorical field C26"),
    (line(1, cats=["0x1f"] + ["0a"] * 25), "categorical field C1"),
    (line(1, cats=["1" * 17] + ["0a"] * 25), "categorical field C1"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_LINES)
def test_malformed_line_stops_with_file_and_line(tmp_path: Path, bad: str, reason: str) -> None:
    lines = [marked(i) for i in range(6)]
    lines.insert(4, bad)  # line 5 of the file
    path = write(tmp_path / "a.tsv", lines)
    r = reader([path], batch_size=3)
    r.next_batch()
    state = r.state_dict()
    with pytest.raises(MalformedLineError, match=reason) as info:
        r.next_batch()
    assert f"{path}:5: " in str(info.value)
    assert isinstance(info.value, ValueError) and info.value.line_number == 5
    assert r.state_dict() == state  # left at the start of the failed batch


def test_line_numbers_are_right_mid_file_and_in_later_files(tmp_path: Path) -> None:
    first = [marked(i) for i in range(20)]
    first[17] = line(7)  # line 18 of the first file, in rank 1's half
    second = [marked(i) for i in range(20, 30)]
    second[2] = line(1, cats=["g"] + ["0a"] * 25)  # line 3 of the second file
    paths = [write(tmp_path / "a.tsv", first, newline="\r\n"), write(tmp_path / "b.tsv", second)]
    rank0 = reader(paths, batch_size=1, rank=0, world_size=2)
    seen = read_one_epoch(rank0)  # rank 0 reads its half without meeting the bad lines
    assert seen == list(range(len(seen))) and 10 <= len(seen) < 18
    rank1 = reader(paths, batch_size=4, rank=1, world_size=2)
    start = rank1.state_dict()
    assert start["file_index"] == 0 and start["byte_offset"] > 0  # starts mid-file
    with pytest.raises(MalformedLineError, match=rf"{re.escape(paths[0])}:18: label must be 0 or 1"):
        for _ in range(5):
            rank1.next_batch()
    skipper = reader(paths, batch_size=1, rank=1, world_size=2, on_malformed="skip")
    while skipper.skipped_lines == 0:
        skipper.next_batch()
    rank1.load_state_dict(skipper.state_dict())  # past line 18; the next batches span files
    with pytest.raises(MalformedLineError, match=rf"{re.escape(paths[1])}:3: categorical field C1") as info:
        for _ in range(5):
            rank1.next_batch()
    assert info.value.path == paths[1] and info.value.line_number == 3


def test_skip_counts_and_keeps_only_good_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = [marked(i) for i in range(8)]
    lines[2] = line(3)  # line 3
    lines[5] = "garbage"  # line 6
    path = write(tmp_path / "a.tsv", lines, newline="\r\n")
    r = reader([path], batch_size=4, on_malformed="skip")
    with caplog.at_level(logging.WARNING, logger="trainer.data.criteo"):
        assert markers(r.next_batch()) == [0, 1, 3, 4]
        assert r.skipped_lines == 1
        assert markers(r.next_batch()) == [6, 7, 0, 1]  # wrapped
        assert markers(r.next_batch()) == [3, 4, 6, 7]
    assert r.skipped_lines == 4 and r.state_dict()["skipped_lines"] == 4
    messages = [rec.getMessage() for rec in caplog.records]
    assert sum(f"{path}:3: " in m for m in messages) == 2
    assert sum(f"{path}:6: " in m for m in messages) == 2
    restored = reader([path], batch_size=4, on_malformed="skip")
    restored.load_state_dict(r.state_dict())
    assert restored.skipped_lines == 4


def test_skip_logging_is_rate_limited(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = ["bad"] * 2500 + [marked(0)]
    path = write(tmp_path / "a.tsv", lines)
    r = reader([path], batch_size=1, on_malformed="skip")
    with caplog.at_level(logging.WARNING, logger="trainer.data.criteo"):
        assert markers(r.next_batch()) == [0]
    assert r.skipped_lines == 2500
    logged = [rec.getMessage() for rec in caplog.records if "skipping" in rec.getMessage()]
    assert len(logged) == 10 + 2  # the first 10, then the 1000th and the 2000th
    assert f"{path}:2000: " in logged[-1]


def test_skip_with_no_valid_line_fails_instead_of_spinning(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tsv", ["bad", "worse"])
    with pytest.raises(ValueError, match="no valid line"):
        reader([path], on_malformed="skip").next_batch()


FIELD = st.sampled_from(
    [
        "",
        "0",
        "1",
        "2",
        "-",
        "-7",
        "12",
        "ab",
        "AB",
        "0x1",
        "1.5",
        " 1",
        "g",
        "\r",
        "f" * 16,
        "f" * 17,
        "9" * 18,
        "9" * 19,
        "-" + "9" * 18,
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(st.lists(FIELD, min_size=38, max_size=42), min_size=1, max_size=12))
def test_vectorised_parser_agrees_with_diagnose_line(records: list[list[str]]) -> None:
    """A line is yielded exactly when ``diagnose_line`` finds nothing wrong with it, and
    its values are those of a plain per-field Python decoder."""
    lines = [marked(10_000)] + ["\t".join(fields) for fields in records] + [marked(10_001)]
    valid = [text for text in lines if diagnose_line(text.encode()) is None]
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "a.tsv", lines)
        r = reader([path], batch_size=len(valid), on_malformed="skip")
        batch = r.next_batch()
    assert r.skipped_lines == len(lines) - len(valid)
    assert r.state_dict()["epoch"] == 1 and r.state_dict()["byte_offset"] == 0
    assert_batches_equal(batch, reference_batch(valid))


def reference_batch(lines: list[str]) -> Batch:
    """Decode valid records one field at a time with Python's int()."""
    rows = [text.rstrip("\r").split("\t") for text in lines]
    labels = torch.tensor([float(f[0]) for f in rows], dtype=torch.float32)
    dense = torch.tensor([[np.float32(math.log1p(max(int(v or 0), 0))) for v in f[1:14]] for f in rows], dtype=torch.float32)
    values, lengths = [], []
    for j, size in enumerate(SIZES):
        for f in rows:
            cat = f[14 + j]
            lengths.append(1 if cat else 0)
            values += [int(cat, 16) % size] if cat else []
    kjt = KeyedJaggedTensor(
        keys=NAMES,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


# -- arguments and speed -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "argument"),
    [
        (dict(on_malformed="ignore"), "on_malformed"),
        (dict(feature_names=NAMES[:25], num_embeddings=SIZES[:25]), "feature_names"),
        (dict(num_embeddings=SIZES[:25]), "num_embeddings"),
        (dict(num_embeddings=[0] + SIZES[1:]), "num_embeddings"),
        (dict(paths=[]), "paths"),
        (dict(paths=["/nonexistent/x.tsv"]), "paths"),
        (dict(rank=1, world_size=1), "rank"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_bad_arguments_are_rejected(tmp_path: Path, overrides: dict, argument: str) -> None:
    kwargs = {"paths": [write(tmp_path / "a.tsv", [marked(0)])], **overrides}
    with pytest.raises(ValueError, match=argument):
        reader(**kwargs)
