"""The restore's kernel path into GPU shards: decode on the host into pinned staging buffers,
copy to the device behind the host's back.

Into a CPU shard the kernel (:mod:`ckpt.restore.kernel`) decodes each kept row straight into its
shard row. A GPU shard cannot be written from the host, so `StagedReplay` chooses the rows exactly
as there (`FusedReplay.select`: the `written`/`covered` bookkeeping stays on the host), decodes
them into the next buffer of a small ring (`StagingRing`, rows contiguous: the frame's kept rows
are the buffer's rows 0..kept-1), and queues the buffer's device work on a side stream: a copy
straight into the shard's slice where the destination rows are one run, else one copy of the
buffer (rows and their destination indices) and an `index_copy_` per tensor. The host meanwhile
decodes the next frame into another buffer; a buffer is decoded into again only once the copies
from its previous frame are done (an event per buffer).

Where the device work runs is a `HostQueue`: at once, on the host, for CPU "device" shards (the
same logic, tested on any machine against the direct kernel and the torch path), or a
`CudaQueue` (a side stream and its events: the only CUDA-specific code). Anything else that
touches the shards on the device (the torch path's frames, the finish) first makes the current
stream wait for the side stream (`StagedReplay.join`), and the restore ends with the side
stream's work done (`StagedReplay.finish`), so writes land in the order the replay issued them
(docs/design/restore.md).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
import torch

from ckpt.restore.kernel import FusedReplay, Written, fits_on
from ckpt.stream.frames import Frame
from sharding.shard_views import ShardView

__all__ = ["CudaQueue", "HostQueue", "StagedReplay", "StagingRing", "run_start", "staged_for", "to_device"]

SLOTS = 3  # staging buffers: one being decoded into, the others' copies in flight
_ALIGN = 64  # bytes: each part of a staging buffer starts on a multiple (views as float32 / int64)


class HostQueue:
    """Where a staged frame's device work runs, for shards on the host: at once, so there is
    nothing to wait for. The same calls as `CudaQueue`, for the staged path's logic on CPU."""

    pinned = False  # whether staging buffers are pinned (page-locked) host memory

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def run(self, work: Callable[[], None]) -> None:
        """Queue `work` (device copies and writes) after the work queued before it."""
        with torch.no_grad():
            work()

    def mark(self) -> object | None:
        """A mark of the work queued so far, for `wait` (None: nothing in flight)."""
        return None

    def wait(self, mark: object | None) -> None:
        """Block the host until the work queued before `mark` is done."""

    def join(self) -> None:
        """Order what the current stream does next after the work queued so far (no host wait)."""

    def drain(self) -> None:
        """`join`, and block the host until every queued work is done."""
        self.join()


class CudaQueue(HostQueue):
    """A staged frame's device work on a side stream of `device`; marks are its CUDA events."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._after_current = False  # whether the side stream already waits for the current stream's work

    def run(self, work: Callable[[], None]) -> None:
        if not self._after_current:  # the shards' earlier writes (their allocation, the torch path) go first
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._after_current = True
        with torch.cuda.stream(self.stream), torch.no_grad():
            work()

    def mark(self) -> torch.cuda.Event:
        return self.stream.record_event()

    def wait(self, mark: object | None) -> None:
        if isinstance(mark, torch.cuda.Event):
            mark.synchronize()

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._after_current = False  # the current stream may write the shards next: the next run waits for it

    def drain(self) -> None:
        self.join()
        self.stream.synchronize()


class StagingRing:
    """`slots` host buffers (pinned where the queue's device needs it) used in turn: the host
    decodes a frame into one while the device copies from the others. A buffer is handed out
    again only once the queue's work from its last use is done, and grows to the largest frame
    asked of it (a freed pinned buffer goes back to torch's caching host allocator, which holds
    it until its copies are done and gives it to the next restore)."""

    def __init__(self, queue: HostQueue, slots: int = SLOTS) -> None:
        if slots < 1:
            raise ValueError(f"a staging ring needs a buffer, got {slots}")
        self.queue = queue
        self.buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(slots)]
        self.marks: list[object | None] = [None] * slots
        self.next = 0
        self.grown = 0  # buffers allocated (growth included)
        self.waits = 0  # takes that found the buffer's last copies queued (the host may have waited)

    def take(self, nbytes: int) -> tuple[int, torch.Tensor, float]:
        """(slot, its uint8 buffer of at least `nbytes`, seconds waited for its last copies)."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        t = time.perf_counter()
        if self.marks[i] is not None:
            self.waits += 1
            self.queue.wait(self.marks[i])
            self.marks[i] = None
        wait_s = time.perf_counter() - t
        if self.buffers[i].numel() < nbytes:
            self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.queue.pinned)
            self.grown += 1
        return i, self.buffers[i], wait_s

    def issued(self, slot: int, mark: object | None) -> None:
        """The work reading slot `slot` is queued up to `mark`."""
        self.marks[slot] = mark


class _Layout(NamedTuple):
    """Where a staged frame's parts lie in its buffer: float32 [rows, width] per target tensor
    (the weights, then each optimizer state), then the rows' int64 destination indices when the
    rows are scattered."""

    rows: int
    widths: tuple[int, ...]
    offsets: tuple[int, ...]  # bytes: each part's start, then the indices' (scattered rows only)
    nbytes: int

    @classmethod
    def of(cls, rows: int, widths: tuple[int, ...], indices: bool) -> _Layout:
        offsets, at = [], 0
        for w in widths:
            offsets.append(at)
            at = -(-(at + rows * 4 * w) // _ALIGN) * _ALIGN
        if indices:
            offsets.append(at)
            at += rows * 8
        return cls(rows, widths, tuple(offsets), at)

    def parts(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The float32 parts, views of `buf` (uint8, on any device)."""
        return [buf[o : o + self.rows * 4 * w].view(torch.float32).view(self.rows, w) for o, w in zip(self.offsets, self.widths)]

    def indices(self, buf: torch.Tensor) -> torch.Tensor:
        o = self.offsets[len(self.widths)]
        return buf[o : o + self.rows * 8].view(torch.int64)


def run_start(rows: np.ndarray) -> int | None:
    """``rows[0]`` when `rows` are ``rows[0], rows[0] + 1, ...`` (one slice of the shard), else None."""
    first = int(rows[0])
    if int(rows[-1]) - first != rows.shape[0] - 1:
        return None
    return first if rows.shape[0] < 2 or bool((np.diff(rows) == 1).all()) else None


def _write_rows(targets: list[torch.Tensor], staged: torch.Tensor, layout: _Layout, start: int | None) -> None:
    """The device work of one staged frame: its rows into `targets` (the shard's tensors as
    [rows, width]), from `staged` (its buffer, on the host)."""
    if start is not None:  # one run: each part straight into its slice, no temporaries
        for dst, src in zip(targets, layout.parts(staged)):
            dst[start : start + layout.rows].copy_(src, non_blocking=True)
        return
    on_device = staged.to(targets[0].device, non_blocking=True)  # one copy: every part and the indices
    rows = layout.indices(on_device)
    for dst, src in zip(targets, layout.parts(on_device)):
        dst.index_copy_(0, rows, src)


class StagedReplay:
    """One restore's kernel writes into shards on `queue.device`, through a `StagingRing`.

    Same interface as `FusedReplay` (`fits`, `write`), plus `join` (before anything else
    touches the shards on the device) and `finish` (the end of the restore)."""

    def __init__(self, fused: FusedReplay, queue: HostQueue, slots: int = SLOTS) -> None:
        self.fused = fused
        self.queue = queue
        self.ring = StagingRing(queue, slots)
        self._rows = np.empty(0, np.int64)  # 0, 1, 2, ...: a frame's kept rows are its buffer's first rows
        self.frames = 0  # writes staged ...
        self.runs = 0  # ... of which copied straight into one slice of the shard

    @property
    def device(self) -> torch.device:
        return self.queue.device

    def fits(self, frame: Frame, s: ShardView) -> bool:
        """Whether the kernel writes this frame into shard `s` through staging (else the torch path)."""
        return fits_on(frame, s, self.queue.device)

    def write(self, frame: Frame, s: ShardView, link: int, written: np.ndarray, covered: np.ndarray, cols: int) -> Written:
        """As `FusedReplay.write`, the rows decoded into a staging buffer and their device work
        queued: when this returns, the rows may still be on their way."""
        kept, inside = self.fused.select(frame, s, link, written, covered, cols)
        if not kept:
            return Written(0, inside, 0.0)
        whole_run = frame.first_row is not None and kept == inside  # every row of a run: its local rows in order
        start = int(self.fused.dst[0]) if whole_run else run_start(self.fused.dst[:kept])
        targets = [s.weight, *(state.view(s.num_rows, -1) for state in s.optimizer_states.values())]
        layout = _Layout.of(kept, tuple(t.shape[1] for t in targets), indices=start is None)
        slot, buf, wait_s = self.ring.take(layout.nbytes)
        parts = layout.parts(buf)
        if self._rows.shape[0] < kept:
            self._rows = np.arange(kept, dtype=np.int64)
        states = {name: part.numpy().view(np.uint8) for name, part in zip(s.optimizer_states, parts[1:])}
        decode_s = self.fused.decode_into(frame, kept, self._rows, parts[0].numpy(), states)
        if start is None:
            layout.indices(buf).numpy()[:] = self.fused.dst[:kept]
        self.queue.run(functools.partial(_write_rows, targets, buf[: layout.nbytes], layout, start))
        self.ring.issued(slot, self.queue.mark())
        self.frames += 1
        self.runs += int(start is not None)
        return Written(kept, inside, decode_s, wait_s)

    def join(self) -> None:
        """Make what the current stream does next wait for the staged writes queued so far."""
        self.queue.join()

    def finish(self) -> float:
        """Every staged write done and the current stream after them; returns the seconds waited."""
        t = time.perf_counter()
        self.queue.drain()
        return time.perf_counter() - t


def staged_for(shards: Iterable[ShardView], fused: FusedReplay) -> StagedReplay | None:
    """The staged writer for shards on a CUDA device (the first such device met; shards on any
    other take the torch path), or None when none is on one."""
    device = next((s.weight.device for s in shards if s.weight.device.type == "cuda"), None)
    return None if device is None else StagedReplay(fused, CudaQueue(device))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`. For a GPU through a pinned copy, queued on the current stream
    without blocking the host (from pageable memory the copy is synchronous); the pinned block
    goes back to torch's caching host allocator, which keeps it until the copy is done."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)
