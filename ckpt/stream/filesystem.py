"""Filesystem backend: frame sink, frame source and marker log in plain files.

Layout under ``root``::

    <run>.rows.g<N>/<partition>.seg    append-only segment per (generation, partition)
    <run>.markers.log                  append-only marker log

Both are sequences of records ``magic "DRR1" | length u32 | crc32 u32 | payload``; the
CRC covers magic, length and payload. A position is the *byte offset* of a record:
a reader seeks straight to the start of a range with no index (record numbers would
need one, or a scan from the start), and positions stay valid when the file grows.

Durability: ``flush()`` / ``append_marker()`` fsync the file, and the directory when it
created the file. A crash mid-append leaves a *torn tail*: an incomplete record, or a
complete one whose CRC fails, at the very end of the file (or zeros there after a power
loss). Readers scanning a file stop before a torn tail; a writer that opens a file
truncates it first. An invalid record with valid-looking data after it is corruption,
never skipped: ``FrameError`` names file and byte offset.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Literal, overload

from ckpt.stream.frames import Frame, FrameError, decode_frame, file_where
from ckpt.stream.sink import (
    RangeRead,
    RangeRecorder,
    SinkError,
    SinkResult,
    SourceError,
    TailRead,
    check_run_id,
    markers_name,
    parse_rows_name,
    read_one_by_one,
    rows_name,
)
from common.checksum import crc32
from common.files import fsync_dir

log = logging.getLogger(__name__)

REC_MAGIC = b"DRR1"
_REC = struct.Struct("<4sII")  # magic, payload length, crc32(magic + length + payload)
_READ_CHUNK = 1 << 20  # bytes read at a time when checking a tail of zeros or searching for an intact record


def _rec_crc(length: int, payload: bytes | memoryview) -> int:
    return crc32(payload, crc32(REC_MAGIC + struct.pack("<I", length)))


def encode_record(payload: bytes | memoryview) -> tuple[bytes, int]:
    """(record header, total record size) for ``payload``."""
    n = len(payload)
    return _REC.pack(REC_MAGIC, n, _rec_crc(n, payload)), _REC.size + n


def _zeros_to_end(f: BinaryIO, pos: int) -> bool:
    f.seek(pos)
    while chunk := f.read(_READ_CHUNK):
        if chunk.count(0) != len(chunk):
            return False
    return True


def _valid_record_after(f: BinaryIO, start: int, size: int) -> int | None:
    """The byte offset of the first complete record with a valid CRC at or after `start`, if any.

    A record whose length runs past the end of the file is a torn tail only if nothing valid
    follows it: the last append of a killed writer. A flipped bit in the length of an earlier
    record looks the same from its header, and taking it for a tail would hide (and a writer
    would cut) every record after it. Only called on that path, so the extra reading is rare;
    it goes in chunks, reading a candidate's payload only where its magic is."""
    chunk_start = start
    while chunk_start < size:
        f.seek(chunk_start)
        chunk = f.read(_READ_CHUNK + len(REC_MAGIC) - 1)  # a magic across the boundary too
        at = chunk.find(REC_MAGIC)
        while 0 <= at < _READ_CHUNK:
            f.seek(chunk_start + at)
            head = f.read(_REC.size)
            if len(head) == _REC.size:
                _, length, crc = _REC.unpack(head)
                if chunk_start + at + _REC.size + length <= size and _rec_crc(length, f.read(length)) == crc:
                    return chunk_start + at
            at = chunk.find(REC_MAGIC, at + 1)
        chunk_start += _READ_CHUNK
    return None


def _refuse_if_records_follow(f: BinaryIO, path: object, pos: int, size: int, what: str) -> None:
    """Raise ``FrameError`` when the would-be torn tail at `pos` has a valid record inside it."""
    later = _valid_record_after(f, pos + _REC.size, size)
    if later is not None:
        raise FrameError(
            f"{what}, but a complete record starts at byte {later}: a damaged length, not a torn tail", file_where(path, pos)
        )


@overload
def scan_records(
    f: BinaryIO, path: object, start: int = 0, *, verify: Literal[True] = True, skip_damaged: bool = False
) -> Iterator[tuple[int, int, bytes]]: ...


@overload
def scan_records(
    f: BinaryIO, path: object, start: int = 0, *, verify: Literal[False], skip_damaged: bool = False
) -> Iterator[tuple[int, int, None]]: ...


def scan_records(
    f: BinaryIO, path: object, start: int = 0, *, verify: bool = True, skip_damaged: bool = False
) -> Iterator[tuple[int, int, bytes | None]]:
    """Yield ``(position, end, payload)`` of every complete, valid record from ``start``,
    stopping silently before a torn tail and raising ``FrameError`` on corruption.

    ``verify=False`` reads headers only (payload None) and checks the CRC of the last
    record alone: that is where a torn write can be (used to find a writer's end).
    ``skip_damaged`` (the markers log, docs/design/failures.md): corruption with an intact record
    after it is skipped with a warning naming file and bytes, and reading goes on at that
    record; damage with nothing intact after it reads as a torn tail.
    """
    size = os.fstat(f.fileno()).st_size
    pos = start
    while pos < size:
        f.seek(pos)
        head = f.read(_REC.size)
        torn = f"torn tail of {size - pos} bytes"
        if len(head) < _REC.size:
            log.info("%s: %s (incomplete record header)", file_where(path, pos), torn)
            return
        magic, length, crc = _REC.unpack(head)
        end = pos + _REC.size + length
        try:
            if magic != REC_MAGIC:
                if _zeros_to_end(f, pos):
                    log.info("%s: %s (zero fill)", file_where(path, pos), torn)
                    return
                raise FrameError(f"bad record magic {magic!r}, expected {REC_MAGIC!r}", file_where(path, pos))
            if end > size:
                _refuse_if_records_follow(f, path, pos, size, f"record length {length} runs past the end of the file")
                log.info("%s: %s (record of %d bytes cut short)", file_where(path, pos), torn, length)
                return
            payload = None
            if verify or end == size:
                f.seek(pos + _REC.size)
                payload = f.read(length)
                if _rec_crc(length, payload) != crc:
                    if end == size:
                        _refuse_if_records_follow(f, path, pos, size, "the record that ends the file fails its CRC")
                        log.info("%s: %s (last record fails its CRC)", file_where(path, pos), torn)
                        return
                    raise FrameError(f"record CRC mismatch ({length}-byte record, more data follows)", file_where(path, pos))
                if not verify:
                    payload = None
        except FrameError as exc:
            if not skip_damaged:
                raise
            later = _valid_record_after(f, pos + 1, size)
            if later is None:
                log.warning("%s; nothing intact after it: read as a torn tail", exc)
                return
            log.warning("%s; skipped %d damaged bytes, the next intact record starts at byte %d", exc, later - pos, later)
            pos = later
            continue
        yield pos, end, payload
        pos = end


class _Appender:
    """One append-only record file, opened lazily; truncates a torn tail on open (``exclusive``)
    or when it catches up holding the file's lock (a shared file: `catch_up`).

    ``exclusive``: hold an exclusive `flock` while open, so a segment has one writer at a time.
    Two processes appending to one file would interleave their records; a second writer
    (another trainer attempt of the same run, ckpt/log/fencing.py) fails its write instead."""

    def __init__(self, path: Path, *, exclusive: bool = False, skip_damaged: bool = False) -> None:
        self.path = path
        self.exclusive = exclusive
        self.skip_damaged = skip_damaged  # the markers log: damage mid-file is skipped, not an error
        self._f: BinaryIO | None = None
        self.end = 0
        self._sync_dirs: set[Path] = set()  # dirs whose entries we created: fsync once
        self.dirty = False

    def _open(self) -> BinaryIO:
        if self._f is None:
            parent = self.path.parent
            missing = [p for p in [parent, *parent.parents] if not p.exists()]
            parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            f = open(self.path, "a+b")
            try:
                if self.exclusive:
                    self._lock(f)
                # a shared file's tail is another process's append in progress until its lock is
                # held: `catch_up`, under that lock, finds the end and cuts a torn tail
                end = self._cut_torn_tail(f, 0) if self.exclusive else 0
            except BaseException:
                f.close()
                raise
            self._f, self.end = f, end
            self._sync_dirs = {d.parent for d in missing} | ({parent} if created else set())
        return self._f

    def _lock(self, f: BinaryIO) -> None:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SinkError(
                f"{self.path} is being written by another process (two attempts of one run at "
                f"once?); this checkpoint's rows are not written"
            ) from None

    def open_file(self) -> BinaryIO:
        """The open file (opening an exclusive one cuts a torn tail)."""
        return self._open()

    def catch_up(self) -> None:
        """Move `end` past records another process appended since (call it holding the
        file's lock); a torn tail after them, left by a killed writer, is cut."""
        self.end = self._cut_torn_tail(self._open(), self.end)

    def _cut_torn_tail(self, f: BinaryIO, start: int) -> int:
        """The end of the last complete record from `start` on; anything after it is cut."""
        end = start
        for _, end, _ in scan_records(f, self.path, start, verify=False, skip_damaged=self.skip_damaged):  # noqa: B007 - the last end
            pass
        size = os.fstat(f.fileno()).st_size
        if end < size:
            log.warning("%s: truncating torn tail of %d bytes", self.path, size - end)
            f.truncate(end)
            os.fsync(f.fileno())
        return end

    def append(self, payload: bytes | memoryview) -> tuple[int, int]:
        """Append one record; returns (position, end). Not durable until ``sync()``."""
        f = self._open()
        head, size = encode_record(payload)
        pos = self.end
        f.write(head)
        f.write(payload)
        self.end = pos + size
        self.dirty = True
        return pos, self.end

    def sync(self) -> None:
        if self._f is not None and self.dirty:
            self._f.flush()
            os.fsync(self._f.fileno())
            self.dirty = False
        for d in sorted(self._sync_dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        self._sync_dirs = set()

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            finally:
                self._f = None


class FsSink:
    """Frames of generation N to ``<root>/<run>.rows.g<N>/<partition>.seg``."""

    def __init__(self, root: str | os.PathLike, run_id: str) -> None:
        self.root = Path(root)
        self.run_id = check_run_id(run_id)
        self._files: dict[tuple[int, int], _Appender] = {}
        self._dropped: set[int] = set()
        self._rec = RangeRecorder()
        self._error: SinkError | None = None
        self._closed = False

    def segment_path(self, generation: int, partition: int) -> Path:
        return self.root / rows_name(self.run_id, generation) / f"{partition}.seg"

    def write(self, frame: bytes, *, generation: int, partition: int) -> None:
        if self._closed:
            raise SinkError("sink is closed")
        if generation in self._dropped or partition < 0:
            err = SinkError(
                f"generation {generation} was dropped; refusing to write it"
                if generation in self._dropped
                else f"bad partition {partition}"
            )
            self._error = self._error or err  # the flush must not claim a complete write
            raise err
        key = (generation, partition)
        app = self._files.get(key)
        if app is None:
            app = self._files[key] = _Appender(self.segment_path(generation, partition), exclusive=True)
        try:
            pos, end = app.append(frame)
        except (OSError, FrameError, SinkError) as e:
            err = e if isinstance(e, SinkError) else SinkError(f"cannot append to {app.path}: {e}")
            self._error = self._error or err
            # The file may end in a partial record now: reopen (and cut it) on next use.
            self._files.pop(key, None)
            try:
                app.close()
            except OSError:
                pass
            raise err from None
        self._rec.add(key, pos, end)

    def flush(self, timeout_s: float | None = None) -> SinkResult:
        """fsync every segment written since the last flush (``timeout_s`` is not
        enforceable for fsync and is ignored)."""
        if self._closed:
            raise SinkError("sink is closed")
        for app in self._files.values():
            try:
                app.sync()
            except OSError as e:
                self._error = self._error or SinkError(f"cannot fsync {app.path}: {e}")
        result = self._rec.result(self._error)
        self._rec, self._error = RangeRecorder(), None
        if not result.ok:  # reopen (and cut any torn tail) on the next write
            for app in self._files.values():
                app.close()
            self._files.clear()
        return result

    def generations(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (parse_rows_name(self.run_id, d.name) for d in self.root.iterdir() if d.is_dir())
        return sorted(g for g in found if g is not None)

    def drop_generation(self, generation: int) -> None:
        self._dropped.add(generation)
        for key in [k for k in self._files if k[0] == generation]:
            self._files.pop(key).close()
        d = self.root / rows_name(self.run_id, generation)
        shutil.rmtree(d, ignore_errors=True)
        if d.exists():
            raise SinkError(f"cannot delete {d}")
        if self.root.exists():
            fsync_dir(self.root)

    def close(self) -> None:
        self._closed = True
        for app in self._files.values():
            app.close()
        self._files.clear()


class FsSource:
    def __init__(self, root: str | os.PathLike, run_id: str) -> None:
        self.root = Path(root)
        self.run_id = check_run_id(run_id)

    def segment_path(self, generation: int, partition: int) -> Path:
        return self.root / rows_name(self.run_id, generation) / f"{partition}.seg"

    def read_range(self, generation: int, partition: int, first: int, last: int) -> Iterator[tuple[int, Frame]]:
        """Frames whose records start at byte offsets ``first`` through ``last``.

        Only the frame CRC is checked here (the record CRC covers the same bytes): the
        range was acknowledged, so there is no torn tail to tell apart in it.
        """
        if not 0 <= first <= last:
            raise ValueError(f"bad range [{first}, {last}]")
        path = self.segment_path(generation, partition)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise SourceError(f"segment {path} does not exist (reading bytes {first}..{last})") from None
        return self._frames(f, path, first, last)

    reads_ahead_used = 0  # files are never read ahead

    def prepare(self) -> None:
        """Files need no connecting."""

    def read_ahead(self, reads: Sequence[RangeRead]) -> None:
        """Files are read on demand (the page cache makes a read a copy)."""

    def read_ranges(self, reads: Sequence[RangeRead]) -> Iterator[tuple[int, int, Frame]]:
        """Local files: one after another (the page cache makes a read a copy)."""
        return read_one_by_one(self, reads)

    def _frames(self, f: BinaryIO, path: Path, first: int, last: int) -> Iterator[tuple[int, Frame]]:
        with f:
            size = os.fstat(f.fileno()).st_size
            pos = first
            f.seek(pos)
            while True:
                head = f.read(_REC.size)
                if len(head) < _REC.size:
                    raise SourceError(f"segment {path} ends at byte {size}, but the range runs through byte {last}")
                magic, length, _ = _REC.unpack(head)
                if magic != REC_MAGIC:
                    raise FrameError(
                        f"no record starts here (magic {magic!r}); range [{first}, {last}] is not on record boundaries",
                        file_where(path, pos),
                    )
                if pos + _REC.size + length > size:
                    raise SourceError(
                        f"segment {path} ends inside the record at byte {pos}, which the range [{first}, {last}] includes"
                    )
                payload = f.read(length)
                frame = decode_frame(payload, where=file_where(path, pos))
                if frame.run_id != self.run_id:
                    raise FrameError(f"frame of run {frame.run_id!r} in run {self.run_id!r}", file_where(path, pos))
                yield pos, frame
                if pos == last:
                    return
                prev, pos = pos, pos + _REC.size + length
                if pos > last:
                    raise SourceError(f"range end {last} is not a record start in {path} (records start at {prev} and {pos})")

    def scan(self, generation: int, partition: int) -> Iterator[tuple[int, Frame]]:
        """Every complete frame of a segment, ignoring a torn tail (diagnostics, tools)."""
        path = self.segment_path(generation, partition)
        with open(path, "rb") as f:
            for pos, _, payload in scan_records(f, path):
                yield pos, decode_frame(payload, where=file_where(path, pos))

    def close(self) -> None:
        pass


class FsMarkers:
    """The marker log ``<root>/<run>.markers.log``: each append is fsynced before it returns.

    Several processes append (the trainer's rank 0, a follower, `deltarec-ckpt gc`), so an
    append holds an exclusive `flock` on the file: inside it the appender finds the real end
    (records other processes added since), cuts a torn tail a killed writer left, writes and
    fsyncs. A damaged record in the middle is skipped by readers and writers alike, with a
    warning naming file and bytes (docs/design/failures.md): one flipped byte must not make every
    later checkpoint of the run unreadable."""

    def __init__(self, root: str | os.PathLike, run_id: str) -> None:
        self.root = Path(root)
        self.run_id = check_run_id(run_id)
        self.path = self.root / (markers_name(self.run_id) + ".log")
        self._app = _Appender(self.path, skip_damaged=True)

    def append_marker(self, payload: bytes) -> int:
        return self.append_markers([payload])[0]

    def append_markers(self, payloads: Sequence[bytes]) -> list[int]:
        """Every record under one lock, then one fsync."""
        try:
            f = self._app.open_file()
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                self._app.catch_up()
                positions = [self._app.append(payload)[0] for payload in payloads]
                self._app.sync()
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        except (OSError, FrameError) as e:
            self._app.close()
            self._app = _Appender(self.path, skip_damaged=True)  # reopen: cuts what this append left behind
            raise SinkError(f"cannot append marker to {self.path}: {e}") from None
        return positions

    def prepare(self, timeout_s: float) -> None:
        """Files need no connecting."""

    def check_reachable(self, timeout_s: float) -> None:
        """Files need no connection: a root that does not exist yet holds no checkpoint."""

    def read_markers(self, start: int = 0) -> list[tuple[int, bytes]]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            return [(pos, payload) for pos, _, payload in scan_records(f, self.path, start, skip_damaged=True)]

    def read_tail(self, records: int) -> TailRead:
        """The last `records` markers: the record headers from the start (a seek each, no
        payload read or decoded), then the payloads of the last ones, CRC-checked."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return TailRead([], True)
        with f:
            starts = [pos for pos, _, _ in scan_records(f, self.path, verify=False, skip_damaged=True)]
            start = starts[-records] if len(starts) > records else 0
            return TailRead(
                [(pos, payload) for pos, _, payload in scan_records(f, self.path, start, skip_damaged=True)], start == 0
            )

    def close(self) -> None:
        self._app.close()
