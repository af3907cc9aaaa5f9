"""Reader of Criteo Kaggle / Terabyte click logs in TSV form.

Each line is ``label \\t I1..I13 \\t C1..C26``: a 0/1 label, 13 integer (count)
features and 26 categorical features given as hexadecimal hashes (8 hex digits, i.e.
32-bit values, in the public data sets). Any dense or categorical field may be empty.

Decoding (one batch at a time, vectorised with numpy over the raw bytes):

- dense ``I_j``: empty -> 0; integer ``x`` -> ``log1p(max(x, 0))`` as float32 (the
  usual DLRM transform; negative values occur in the Kaggle set and are clamped);
- categorical ``C_j``: empty -> an empty bag (length 0 for that feature in that
  sample); otherwise the id ``int(hex, 16) % num_embeddings[j]`` (1 to 16 hex digits
  accepted, ``0x`` prefixes, signs and spaces are malformed);
- label: exactly ``0`` or ``1``.

Ranks split the files, taken as one logical sequence of lines, by byte ranges: the total
size is cut into ``world_size`` equal byte ranges whose boundaries move forward to the
next line start, and a line belongs to the rank whose range holds its first byte. This
needs no line-counting pass over the (possibly terabyte-sized) input. A rank loops over
its range forever (``epoch`` counts the passes), so training can run any number of
steps, and its position ``(epoch, file_index, byte_offset, skipped_lines)`` is exact.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import BinaryIO

import numpy as np

from trainer.data.reader import (
    Batch,
    DataError,
    make_batch,
    validate_features,
    validate_positive_int,
    validate_rank,
    validate_state,
)

logger = logging.getLogger(__name__)

__all__ = ["CriteoTsvReader", "MalformedLineError", "diagnose_line", "NUM_DENSE", "NUM_SPARSE"]

_OWNER = "CriteoTsvReader"
NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_READ_BLOCK = 4 << 20  # bytes per read: ~20k lines, so most batches parse in one chunk
_SCAN_BLOCK = 1 << 16  # bytes per read when looking for a line start or counting lines
_MAX_HEX_DIGITS = 16  # fits uint64
_MAX_DEC_DIGITS = 18  # fits int64 with a sign
_LOG_FIRST_SKIPS = 10  # skipped lines: warn for the first 10, then every 1000th
_LOG_EVERY_SKIPS = 1000
_ON_MALFORMED = ("stop", "skip")
_STATE_SCHEMA = MappingProxyType({"epoch": int, "file_index": int, "byte_offset": int, "skipped_lines": int})
_DEC_RE = re.compile(rb"-?[0-9]{1,%d}" % _MAX_DEC_DIGITS)
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,%d}" % _MAX_HEX_DIGITS)
_TAB, _NEWLINE, _CR, _MINUS = 9, 10, 13, 45


class MalformedLineError(DataError):
    """A line that is not a valid Criteo record; the message is ``path:line: reason``
    with the 1-based line number within that file."""

    def __init__(self, path: str, line_number: int, reason: str) -> None:
        super().__init__(f"{path}:{line_number}: {reason}")
        self.path = path
        self.line_number = line_number
        self.reason = reason


# -- the per-line reference rules (used to explain a bad line) ---------------------------


def diagnose_line(line: bytes) -> str | None:
    """Return why ``line`` (one record, with or without its ``\\n`` / ``\\r\\n``) is not a
    valid Criteo record, or ``None`` if it is valid.

    These are the rules the vectorised parser applies; it only calls this function to
    word the error of a line it has rejected, so the slow path runs on bad lines only.
    """
    if line.endswith(b"\n"):
        line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line:
        return f"empty line (expected {NUM_FIELDS} tab-separated fields)"
    fields = line.split(b"\t")
    if len(fields) != NUM_FIELDS:
        return f"expected {NUM_FIELDS} tab-separated fields, found {len(fields)}"
    label = fields[0]
    if label not in (b"0", b"1"):
        if _DEC_RE.fullmatch(label):
            return f"label must be 0 or 1, got {_show(label)}"
        return f"label is not an integer: {_show(label)}"
    for j in range(1, 1 + NUM_DENSE):
        if fields[j] and not _DEC_RE.fullmatch(fields[j]):
            return f"dense field I{j} (field {j + 1}) is not an integer: {_show(fields[j])}"
    for j in range(1 + NUM_DENSE, NUM_FIELDS):
        if fields[j] and not _HEX_RE.fullmatch(fields[j]):
            name = f"C{j - NUM_DENSE}"
            return (
                f"categorical field {name} (field {j + 1}) is not a hexadecimal value of at "
                f"most {_MAX_HEX_DIGITS} digits: {_show(fields[j])}"
            )
    return None


def _show(value: bytes) -> str:
    """A field for an error message: quoted, at most 40 characters."""
    text = value[:40].decode("utf-8", "replace")
    return repr(text + ("..." if len(value) > 40 else ""))


# -- vectorised parsing ------------------------------------------------------------------


def _lookup_table(chars: bytes, values: Sequence[int]) -> np.ndarray:
    """A 256-entry uint8 table: byte -> value, 255 for bytes not in ``chars``."""
    table = np.full(256, 255, dtype=np.uint8)
    table[np.frombuffer(chars, dtype=np.uint8)] = values
    table.flags.writeable = False
    return table


_DEC_LUT = _lookup_table(b"0123456789", range(10))
_HEX_LUT = _lookup_table(b"0123456789abcdefABCDEF", list(range(16)) + list(range(10, 16)))


@dataclass(frozen=True)
class _Parsed:
    """The decoded good lines of a chunk, plus where its bad lines start."""

    labels: np.ndarray  # float32 [G]
    dense: np.ndarray  # float32 [G, 13]
    ids: np.ndarray  # uint64 [G, 26], raw hex values (not yet reduced mod table size)
    present: np.ndarray  # bool [G, 26], False for an empty categorical field
    bad_starts: np.ndarray  # int64 [K]: offsets in the chunk of the rejected lines


def _parse_chunk(chunk: bytes) -> _Parsed:
    """Parse a chunk of complete lines (each ending in ``\\n``, optionally ``\\r\\n``).

    Works on the raw bytes: newline and tab positions give every field's start and end;
    fields are gathered right-aligned into fixed-width byte matrices and decoded with
    lookup tables. A line is rejected when any rule of ``diagnose_line`` fails.
    """
    arr = np.frombuffer(chunk, dtype=np.uint8)
    line_end = np.flatnonzero(arr == _NEWLINE)
    line_start = np.concatenate(([0], line_end[:-1] + 1))
    has_cr = (line_end > line_start) & (arr[np.maximum(line_end - 1, 0)] == _CR)
    line_end = line_end - has_cr
    tabs = np.flatnonzero(arr == _TAB)
    first_tab = np.searchsorted(tabs, line_start)
    well_formed = np.searchsorted(tabs, line_end) - first_tab == NUM_FIELDS - 1
    rows = np.flatnonzero(well_formed)
    tab_pos = tabs[first_tab[rows, None] + np.arange(NUM_FIELDS - 1)]
    starts = np.concatenate((line_start[rows, None], tab_pos + 1), axis=1)
    ends = np.concatenate((tab_pos, line_end[rows, None]), axis=1)
    fields = _Fields(np.concatenate((np.zeros(_PAD, dtype=np.uint8), arr)), starts, ends)
    labels, label_bad = _parse_labels(fields)
    dense, dense_bad = _parse_decimal(fields.select(1, 1 + NUM_DENSE))
    ids, hex_bad = _parse_hex(fields.select(1 + NUM_DENSE, NUM_FIELDS))
    good = ~(label_bad | dense_bad | hex_bad)
    bad_line = ~well_formed
    bad_line[rows[~good]] = True
    values = np.maximum(dense[good], 0).astype(np.float64)
    return _Parsed(
        labels=labels[good].astype(np.float32),
        dense=np.log1p(values).astype(np.float32),
        ids=ids[good],
        present=(ends - starts)[good, 1 + NUM_DENSE :] > 0,
        bad_starts=line_start[bad_line],
    )


_PAD = 32  # zero bytes before a chunk: right-aligned windows of <= 19 bytes stay inside


@dataclass(frozen=True)
class _Fields:
    """Field boundaries ``[start, end)`` of the well-formed lines of a chunk, over the
    chunk's bytes preceded by ``_PAD`` zeros."""

    padded: np.ndarray  # uint8 [_PAD + len(chunk)]
    starts: np.ndarray  # int64 [G, columns], offsets into the unpadded chunk
    ends: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Field lengths in bytes."""
        return self.ends - self.starts

    def select(self, first: int, stop: int) -> _Fields:
        """The columns ``first .. stop - 1``."""
        return _Fields(self.padded, self.starts[:, first:stop], self.ends[:, first:stop])

    def first_byte(self) -> np.ndarray:
        """The first byte of every field (the separator after it if it is empty)."""
        return self.padded[self.starts + _PAD]

    def right_aligned(self, width: int) -> np.ndarray:
        """``[..., width]`` bytes ending at each field's end: column ``width - 1`` is the
        last character; shorter fields are preceded by whatever bytes come before them."""
        windows = np.lib.stride_tricks.sliding_window_view(self.padded, width)
        return windows[self.ends + (_PAD - width)]


def _parse_labels(fields: _Fields) -> tuple[np.ndarray, np.ndarray]:
    """Labels must be the single character 0 or 1; returns (0/1 values, bad mask)."""
    first = fields.first_byte()[:, 0].astype(np.int64) - ord("0")
    bad = (fields.lengths[:, 0] != 1) | (first < 0) | (first > 1)
    return first, bad


def _digit_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    """For right-aligned ``width``-byte windows: which columns belong to the field."""
    return np.arange(width) >= (width - lengths)[..., None]


def _parse_decimal(fields: _Fields) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``-?[0-9]{1,18}`` fields (empty -> 0); returns (int64 values, per-row bad)."""
    negative = (fields.lengths > 0) & (fields.first_byte() == _MINUS)
    digits = fields.lengths - negative
    bad = (negative & (digits == 0)) | (digits > _MAX_DEC_DIGITS)
    values = np.zeros(digits.shape, dtype=np.int64)
    width = min(int(digits.max(initial=0)), _MAX_DEC_DIGITS)
    if width:
        decoded = _DEC_LUT[fields.right_aligned(width)]
        valid = _digit_mask(digits, width)
        bad |= ((decoded == 255) & valid).any(axis=-1)
        decoded[~valid] = 0  # leading zeros do not change the value
        for j in range(width):  # Horner over columns
            values *= 10
            values += decoded[..., j]
    np.negative(values, out=values, where=negative)
    return values, np.asarray(bad.any(axis=-1))


def _parse_hex(fields: _Fields) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``[0-9a-fA-F]{1,16}`` fields (empty -> 0, marked absent by the caller);
    returns (uint64 values, per-row bad)."""
    lengths = fields.lengths
    bad = lengths > _MAX_HEX_DIGITS
    values: np.ndarray = np.zeros(lengths.shape, dtype=np.uint64)
    width = min(int(lengths.max(initial=0)), _MAX_HEX_DIGITS)
    if width:
        decoded = _HEX_LUT[fields.right_aligned(width)]
        valid = _digit_mask(lengths, width)
        bad |= ((decoded == 255) & valid).any(axis=-1)
        decoded[~valid] = 0
        for j in range(width):
            values <<= np.uint64(4)
            values |= decoded[..., j]
    return values, np.asarray(bad.any(axis=-1))


# -- splitting the input between ranks ---------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    """The part ``[start, end)`` of one file that belongs to a rank."""

    file_index: int
    start: int
    end: int


def _plan_segments(paths: list[str], sizes: list[int], rank: int, world_size: int) -> list[_Segment]:
    """Cut the concatenated input into ``world_size`` line-aligned byte ranges and return
    ``rank``'s as per-file segments. Every rank computes every boundary, so all ranks
    agree and all fail together when some rank would get no line."""
    total = sum(sizes)
    if total == 0:
        raise DataError(f"{_OWNER}: the input files are empty: {paths}")
    file_starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    bounds = [_next_line_start(paths, sizes, file_starts, k * total // world_size) for k in range(world_size + 1)]
    for r in range(world_size):
        if bounds[r] >= bounds[r + 1]:
            raise DataError(
                f"{_OWNER}: the input has too few lines for world_size={world_size} ranks: "
                f"rank {r}'s byte range of the {total} input bytes holds no line start"
            )
    lo, hi = bounds[rank], bounds[rank + 1]
    segments = []
    for i, (file_start, size) in enumerate(zip(file_starts, sizes)):
        start, end = max(lo, file_start), min(hi, file_start + size)
        if start < end:
            segments.append(_Segment(i, start - file_start, end - file_start))
    return segments


def _next_line_start(paths: list[str], sizes: list[int], file_starts: list[int], pos: int) -> int:
    """The first line start at or after global byte ``pos``. Lines start at each file's
    first byte and after each ``\\n`` (a file without a final newline ends its line)."""
    total = file_starts[-1] + sizes[-1]
    if pos <= 0 or pos >= total:
        return min(max(pos, 0), total)
    i = bisect.bisect_right(file_starts, pos) - 1  # the last file starting at or before pos
    offset = pos - file_starts[i]
    if offset == 0:
        return pos
    newline = _find_newline(paths[i], offset - 1)
    return file_starts[i] + (sizes[i] if newline < 0 else newline + 1)


def _find_newline(path: str, offset: int) -> int:
    """Offset of the first ``\\n`` at or after ``offset`` in ``path``, or -1."""
    with open(path, "rb") as f:
        f.seek(offset)
        while block := f.read(_SCAN_BLOCK):
            found = block.find(b"\n")
            if found >= 0:
                return offset + found
            offset += len(block)
    return -1


# -- reading a rank's range --------------------------------------------------------------


class _RangeCursor:
    """Sequential reader of whole lines over a rank's segments, from any line start.

    Keeps a read-ahead buffer of the current segment and the newline positions in it;
    ``take`` hands out runs of complete lines. A final line without ``\\n`` (end of a
    file) gets a virtual one, so every run the parser sees is newline-terminated.
    """

    def __init__(self, paths: list[str], segments: list[_Segment]) -> None:
        self._paths = paths
        self._segments = segments
        self._file: BinaryIO | None = None
        self._file_index = -1
        self.seek(0, segments[0].start)

    def seek(self, segment_index: int, offset: int) -> None:
        """Continue at ``offset`` (a line start) of segment ``segment_index``."""
        self.segment_index = segment_index
        self._buf = b""
        self._buf_start = offset
        self._cursor = 0
        self._newlines = np.empty(0, dtype=np.int64)
        self._next_newline = 0
        self._read_pos = offset

    @property
    def segment(self) -> _Segment:
        """The segment being read."""
        return self._segments[self.segment_index]

    @property
    def offset(self) -> int:
        """File offset of the next line to hand out."""
        return self._buf_start + self._cursor

    def at_segment_end(self) -> bool:
        """True once every line of the current segment has been handed out."""
        return self.offset >= self.segment.end

    def take(self, max_lines: int) -> tuple[bytes, int]:
        """Up to ``max_lines`` (>= 1) complete lines of the current segment and the file
        offset of the first. Call only while ``not at_segment_end()``."""
        while self._next_newline == len(self._newlines):
            if self._read_pos >= self.segment.end:  # all read, yet no complete line left
                raise RuntimeError("take() called at the end of a segment")
            self._fill()
        count = min(max_lines, len(self._newlines) - self._next_newline)
        end = int(self._newlines[self._next_newline + count - 1]) + 1
        start_offset = self.offset
        chunk = self._buf[self._cursor : end]
        self._cursor = end
        self._next_newline += count
        return chunk, start_offset

    def _fill(self) -> None:
        """Read the next block of the segment after the unconsumed tail of the buffer."""
        segment = self.segment
        data = self._read(segment, min(_READ_BLOCK, segment.end - self._read_pos))
        tail = self._buf[self._cursor :]
        self._buf_start += self._cursor
        self._buf = tail + data
        if self._read_pos >= segment.end and self._buf and not self._buf.endswith(b"\n"):
            self._buf += b"\n"  # the file's last line has no newline
        self._cursor = 0
        self._newlines = np.flatnonzero(np.frombuffer(self._buf, dtype=np.uint8) == _NEWLINE)
        self._next_newline = 0

    def _read(self, segment: _Segment, size: int) -> bytes:
        """Read ``size`` bytes of ``segment``'s file at the read position."""
        if self._file_index != segment.file_index:
            self.close()
            self._file = open(self._paths[segment.file_index], "rb")  # noqa: SIM115
            self._file_index = segment.file_index
            self._file.seek(self._read_pos)
        assert self._file is not None
        if self._file.tell() != self._read_pos:
            self._file.seek(self._read_pos)
        data = self._file.read(size)
        if len(data) != size:
            raise OSError(f"{self._paths[segment.file_index]} changed size while being read")
        self._read_pos += size
        return data

    def close(self) -> None:
        """Close the open file, if any."""
        if self._file is not None:
            self._file.close()
        self._file = None
        self._file_index = -1


class _LineNumbers:
    """1-based line numbers of byte offsets, counted lazily.

    Counting happens only when a bad line is reported: a start-up pass would read the
    whole prefix of every rank's range (most of a terabyte for the last rank) for the
    benefit of error messages that usually never come. Counts are remembered per file,
    and a new count starts from the nearest remembered offset before it, so reporting
    many bad lines while reading forward costs one pass over the file in total.
    """

    def __init__(self, paths: list[str]) -> None:
        self._paths = paths
        self._known: list[list[tuple[int, int]]] = [[(0, 0)] for _ in paths]

    def line_number(self, file_index: int, offset: int) -> int:
        """The 1-based number of the line starting at ``offset`` in file ``file_index``."""
        known = self._known[file_index]
        at = bisect.bisect_right(known, (offset, float("inf"))) - 1
        position, newlines = known[at]
        with open(self._paths[file_index], "rb") as f:
            f.seek(position)
            while position < offset:
                block = f.read(min(_SCAN_BLOCK * 16, offset - position))
                if not block:
                    break
                newlines += block.count(b"\n")
                position += len(block)
        bisect.insort(known, (offset, newlines))
        return newlines + 1


# -- the reader --------------------------------------------------------------------------


@dataclass
class _Pieces:
    """Parsed chunks collected for one batch."""

    labels: list[np.ndarray]
    dense: list[np.ndarray]
    ids: list[np.ndarray]
    present: list[np.ndarray]
    rows: int = 0


class CriteoTsvReader:
    """Endless, resumable reader of Criteo TSV files for one rank (implements ``Reader``).

    ``paths`` are read as one sequence of lines; this rank reads only its line-aligned
    byte range of it (see the module docstring) and wraps to the range's start when it is
    exhausted (``epoch`` += 1). A batch may span files and the wrap.

    ``on_malformed``: ``"stop"`` raises ``MalformedLineError`` (``path:line: reason``) on
    the first bad line, leaving the position at the start of the failed batch; ``"skip"``
    drops bad lines, counts them in ``skipped_lines`` (and the state) and logs a warning
    with ``path:line`` for the first 10 and then every 1000th.

    State: ``{"epoch", "file_index", "byte_offset", "skipped_lines"}``, all ints:
    the pass over the range, and the file and byte offset of the next line to read.
    """

    def __init__(
        self,
        *,
        paths: Sequence[str],
        feature_names: Sequence[str],
        num_embeddings: Sequence[int],
        batch_size: int,
        rank: int,
        world_size: int,
        on_malformed: str = "stop",
    ) -> None:
        names, sizes = validate_features(feature_names, num_embeddings, _OWNER)
        if len(names) != NUM_SPARSE:
            raise DataError(f"{_OWNER}: feature_names must name the {NUM_SPARSE} categorical fields, got {len(names)}")
        if on_malformed not in _ON_MALFORMED:
            raise DataError(f"{_OWNER}: on_malformed must be one of {_ON_MALFORMED}, got {on_malformed!r}")
        validate_rank(rank, world_size, _OWNER)
        self.batch_size = validate_positive_int(batch_size, "batch_size", _OWNER)
        self.paths = _check_paths(paths)
        self.feature_names = names
        self.num_embeddings = sizes
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.on_malformed = on_malformed
        self.epoch = 0
        self.skipped_lines = 0
        self._table_sizes = np.asarray(sizes, dtype=np.uint64)
        file_sizes = [os.path.getsize(p) for p in self.paths]
        self._segments = _plan_segments(self.paths, file_sizes, self.rank, self.world_size)
        self._cursor = _RangeCursor(self.paths, self._segments)
        self._line_numbers = _LineNumbers(self.paths)
        first, last = self._segments[0], self._segments[-1]
        logger.info(
            "rank %d/%d reads %s@%d .. %s@%d",
            self.rank,
            self.world_size,
            self.paths[first.file_index],
            first.start,
            self.paths[last.file_index],
            last.end,
        )

    # -- Reader protocol ---------------------------------------------------------------

    def next_batch(self) -> Batch:
        """Return the next ``batch_size`` valid lines of this rank's range."""
        start_state = self.state_dict()
        try:
            pieces = self._collect(self.batch_size)
        except MalformedLineError:
            self.load_state_dict(start_state)  # leave the position before the failed batch
            raise
        return self._assemble(pieces)

    def state_dict(self) -> dict:
        """The exact position: ``epoch``, ``file_index`` and ``byte_offset`` of the next
        line, and the number of lines skipped so far."""
        return {
            "epoch": self.epoch,
            "file_index": self._cursor.segment.file_index,
            "byte_offset": self._cursor.offset,
            "skipped_lines": self.skipped_lines,
        }

    def load_state_dict(self, state: dict) -> None:
        """Seek to a position saved by ``state_dict`` of a reader of the same files, rank
        and world size. Raises ``ValueError`` on wrong keys or types, or a position that
        is not a line start inside this rank's range."""
        checked = validate_state(state, _STATE_SCHEMA, _OWNER)
        for key, value in checked.items():
            if value < 0:
                raise DataError(f"{_OWNER} state key {key!r} must be >= 0, got {value}")
        segment_index = self._segment_of(checked["file_index"], checked["byte_offset"])
        self._cursor.seek(segment_index, checked["byte_offset"])
        self.epoch = checked["epoch"]
        self.skipped_lines = checked["skipped_lines"]

    def close(self) -> None:
        """Close the file being read (reading again reopens it)."""
        self._cursor.close()

    # -- internals ---------------------------------------------------------------------

    def _segment_of(self, file_index: int, offset: int) -> int:
        """Index of the segment holding line start ``offset`` of ``file_index``; raises
        ``ValueError`` if the position is not in this rank's range or not a line start."""
        for i, segment in enumerate(self._segments):
            if segment.file_index == file_index and segment.start <= offset < segment.end:
                if offset > 0 and not _is_line_start(self.paths[file_index], offset):
                    raise DataError(
                        f"{_OWNER} state: byte_offset {offset} of {self.paths[file_index]} is not the start of a line"
                    )
                return i
        ranges = ", ".join(f"file {s.file_index} [{s.start}, {s.end})" for s in self._segments)
        raise DataError(
            f"{_OWNER} state: file_index {file_index}, byte_offset {offset} is outside rank "
            f"{self.rank}'s range ({ranges}); was it saved with other files or world size?"
        )

    def _collect(self, wanted: int) -> _Pieces:
        """Parse lines from the current position until ``wanted`` valid ones are found."""
        pieces = _Pieces([], [], [], [])
        wraps = 0
        while pieces.rows < wanted:
            chunk, chunk_offset = self._cursor.take(wanted - pieces.rows)
            file_index = self._cursor.segment.file_index
            parsed = _parse_chunk(chunk)
            if len(parsed.bad_starts):
                self._handle_bad_lines(chunk, parsed.bad_starts, file_index, chunk_offset)
            if len(parsed.labels):
                pieces.labels.append(parsed.labels)
                pieces.dense.append(parsed.dense)
                pieces.ids.append(parsed.ids)
                pieces.present.append(parsed.present)
                pieces.rows += len(parsed.labels)
            wraps += self._advance_past_segment_end()
            if wraps >= 2 and pieces.rows == 0:
                raise DataError(
                    f"{_OWNER}: rank {self.rank}'s input range has no valid line "
                    f"({self.skipped_lines} malformed lines skipped so far)"
                )
        return pieces

    def _advance_past_segment_end(self) -> int:
        """Move on to the next segment, or wrap to the range start when the last one is
        done (``epoch`` += 1); return 1 on a wrap, else 0."""
        if not self._cursor.at_segment_end():
            return 0
        if self._cursor.segment_index + 1 < len(self._segments):
            next_index = self._cursor.segment_index + 1
            self._cursor.seek(next_index, self._segments[next_index].start)
            return 0
        self.epoch += 1
        self._cursor.seek(0, self._segments[0].start)
        logger.info("rank %d: end of its input range, starting epoch %d", self.rank, self.epoch)
        return 1

    def _handle_bad_lines(self, chunk: bytes, bad_starts: np.ndarray, file_index: int, chunk_offset: int) -> None:
        """Raise for the first bad line (``stop``) or count and log them (``skip``)."""
        for start in bad_starts.tolist():
            if self.on_malformed == "stop":
                raise self._error(chunk, start, file_index, chunk_offset)
            self.skipped_lines += 1
            n = self.skipped_lines
            if n <= _LOG_FIRST_SKIPS or n % _LOG_EVERY_SKIPS == 0:
                error = self._error(chunk, start, file_index, chunk_offset)
                logger.warning("skipping malformed line %s (%d skipped so far)", error, n)

    def _error(self, chunk: bytes, start: int, file_index: int, chunk_offset: int) -> MalformedLineError:
        """The error for the bad line at ``start`` in ``chunk``."""
        end = chunk.index(b"\n", start) + 1
        reason = diagnose_line(chunk[start:end]) or "malformed line"
        line_number = self._line_numbers.line_number(file_index, chunk_offset + start)
        return MalformedLineError(self.paths[file_index], line_number, reason)

    def _assemble(self, pieces: _Pieces) -> Batch:
        """Concatenate parsed chunks into a Batch; reduce ids modulo the table sizes."""
        present = np.concatenate(pieces.present).T  # [26, B], feature-major like a KJT
        ids = (np.concatenate(pieces.ids) % self._table_sizes).T
        return make_batch(
            np.concatenate(pieces.dense),
            ids[present].astype(np.int64),
            present.reshape(-1).astype(np.int32),
            np.concatenate(pieces.labels),
            self.feature_names,
        )


def _check_paths(paths: Sequence[str]) -> list[str]:
    """``paths`` must be a non-empty sequence of existing files."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) or not paths:
        raise DataError(f"{_OWNER}: paths must be a non-empty sequence of file paths, got {paths!r}")
    checked = [os.fspath(p) for p in paths]
    for path in checked:
        if not os.path.isfile(path):
            raise DataError(f"{_OWNER}: paths: {path!r} is not a file")
    return checked


def _is_line_start(path: str, offset: int) -> bool:
    """True if the byte before ``offset`` in ``path`` is a newline."""
    with open(path, "rb") as f:
        f.seek(offset - 1)
        return f.read(1) == b"\n"
