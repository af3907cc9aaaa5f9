"""Reused host memory for CPU snapshots: the stall copies rows into pages that are already mapped.

A fresh host tensor of tens or hundreds of MB comes from ``mmap`` and is handed back with
``munmap`` when freed, so every checkpoint's copy would fault in every page of its buffers
again, on the training thread (docs/history/BENCHMARKS-2026-11.md, "The stall against a copy into
reused memory").
`HostBufferPool` keeps the memory of snapshots the writer has finished with and carves the next
snapshot's tensors out of it.

Ownership: `lend` (training thread) hands out a `Slab` at least as large as asked; the writer
thread gives it back (`give_back`) once every frame of that snapshot is written, and nobody
reads the snapshot's tensors after that. The pool keeps given-back slabs only while they and
the slabs still lent stay within ``keep_bytes`` (the checkpointer passes
``ckpt.write.max_pending_bytes``, the host memory unwritten snapshots may hold anyway), the largest
that fit first: reuse never raises a rank's host memory above that bound.

GPU shards copy their rows into a slab too (ckpt/capture/snapshot.py): there a slab is *pinned*
(page-locked with ``cudaHostRegister``, so the device-to-host copy is asynchronous and at full
speed), which costs time proportional to its size; reusing slabs pays it once, and a slab the
pool drops is unregistered and unmapped, so the pool's bound holds for pinned memory as well
(torch's own pinned allocator keeps every block it ever made).

A slab made inside the stall still faults in its pages there: the first snapshot larger than
every kept slab (a full checkpoint as the trained rows grow, a one-shot diff as it grows
since its base) paid for it inside the stall (docs/history/BENCHMARKS-2026-11.md, "The restore's first fetch
sooner, snapshot memory faulted in ahead"). So half
an interval before each snapshot the checkpointer asks for its likely size
(`reserve_ahead`), and a helper thread of low priority makes and faults in a slab that large,
unless a free slab holds it already or the bound has no room for it; where no free slab holds
it, the largest free one grows in place (`Slab.grow`), so only its new pages are mapped (each
full checkpoint of a job is larger than the last as the trained rows grow). That size is the largest
snapshot the policy may take next, so the same call unmaps a free slab more than twice as
large (and 64 MiB larger): when an `incremental` run's full checkpoint (the first after a
resume copies every trained row) is followed only by much smaller deltas, the rank's host
buffers shrink to what the deltas need instead of keeping a copy of every row (docs/design/dataflow.md,
"Host memory").
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ckpt.capture.threads import lower_thread_priority

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes: every carved tensor starts on a cache line (and any dtype's alignment)
GROWTH = 1.25  # a new slab's capacity over the request: the next delta is usually a little larger
PAGE = 1 << 21  # capacities are whole 2 MiB pages
OS_PAGE = 4096  # one write per page faults a buffer in
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module has no name for it
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whichever thread pins


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _anonymous(capacity: int, huge: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """A private anonymous mapping of `capacity` bytes and a byte tensor over it (the tensor
    holds the mapping; it is unmapped once both are gone). `huge`: ask for transparent huge
    pages, where one fault maps 2 MiB instead of 4 KiB."""
    area = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no THP in this kernel or platform: 4 KiB pages
            pass
    return area, torch.frombuffer(area, dtype=torch.uint8)


class Carver:
    """Carves one contiguous byte buffer, front to back, into tensors (host or device)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # uint8 [capacity]
        self._used = 0

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    @property
    def used(self) -> int:
        """Bytes carved so far (alignment included): the buffer's prefix the tensors occupy."""
        return self._used

    def carve(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype` in the buffer's next free bytes."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = _round_up(self._used, ALIGN)
        assert start + nbytes <= self.capacity, f"buffer of {self.capacity} B cannot hold {start + nbytes} B"
        self._used = start + nbytes
        return self.buffer[start : start + nbytes].view(dtype).view(shape)

    def reset(self) -> None:
        self._used = 0


def _unpin(ptr: int, area: mmap.mmap) -> None:
    """Unregister a pinned slab's pages (its mapping `area` is unmapped only after this)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)
    del area


class Slab(Carver):
    """One contiguous host buffer, carved front to back into tensors of one snapshot.

    `huge` only for a slab mapped ahead (`fault_in`), where huge pages cost less CPU; a stall's
    copy into fresh huge pages was slower than into fresh 4 KiB ones (docs/history/BENCHMARKS-2026-11.md, "Where a checkpoint's
    direct CPU goes; host buffer slabs in huge pages").
    `pin` page-locks it for asynchronous device-to-host copies (GPU snapshots); registering
    maps every page, at the cost a fresh slab's faults have (it stays `fresh`: the stall that
    made it paid for them)."""

    def __init__(self, capacity: int, huge: bool = False) -> None:
        area, buffer = _anonymous(capacity, huge)
        super().__init__(buffer)
        self._area = area
        self._huge = huge
        self.fresh = True  # its pages were never written: the first snapshot in it faults them in
        self.pinned = False  # `pin`

    def pin(self) -> None:
        """Page-lock the slab (`cudaHostRegister`); unregistered when the slab is collected."""
        ptr = self.buffer.data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.capacity, HOST_REGISTER_PORTABLE)
        if int(err) != 0:  # cudaSuccess; an unpinned slab still works, its copies just synchronise
            logger.warning(
                "cannot pin a %d-byte snapshot buffer (CUDA error %s): its copies will be slower", self.capacity, int(err)
            )
            return
        self.pinned = True
        weakref.finalize(self, _unpin, ptr, self._area)

    def fault_in(self) -> None:
        """Map every page now (one `madvise` where the kernel has MADV_POPULATE_WRITE, else
        one write per page), so that the snapshot copied into it later faults nothing. Pages
        already mapped (all but the new ones after `grow`) cost only the walk over them."""
        if self.pinned:  # registering mapped every page
            self.fresh = False
            return
        try:
            self._area.madvise(MADV_POPULATE_WRITE)
        except OSError:  # a kernel before 5.14
            self.buffer[::OS_PAGE].zero_()
        self.fresh = False

    def grow(self, capacity: int) -> bool:
        """Extend this free slab to `capacity` bytes where it is (``mremap``, which moves page
        tables, not pages): the pages a snapshot or `fault_in` mapped stay mapped, so making it
        ready for a larger snapshot (`fault_in`) maps only the new ones, where a new slab would
        have the host back all of them again.
        False, and nothing changed, for a pinned slab (its registration covers the old
        range) or while a tensor carved from it, or any view of one, is alive (its memory
        must stay where it is)."""
        if self.pinned or capacity <= self.capacity:
            return False
        # torch.frombuffer holds the mapping without a buffer export, so `resize` would move it
        # under a live tensor: the tensors' shared storage must be gone once ours is dropped
        ours = StorageWeakRef(self.buffer.untyped_storage())
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if not ours.expired():
            self.buffer = torch.frombuffer(self._area, dtype=torch.uint8)
            return False
        try:
            self._area.resize(capacity)
        except (BufferError, OSError, SystemError, ValueError):  # an export of the mapping; or no mremap here
            self.buffer = torch.frombuffer(self._area, dtype=torch.uint8)
            return False
        if self._huge:
            try:
                self._area.madvise(mmap.MADV_HUGEPAGE)  # the new range as well
            except (AttributeError, OSError):
                pass
        self.buffer = torch.frombuffer(self._area, dtype=torch.uint8)
        return True


SHED_OVER = 2  # a free slab over this many times the capacity the next snapshot needs ...
SHED_MIN = 32 * PAGE  # ... and larger by at least this much is unmapped by `reserve` (no churn of small slabs)


def _oversized(slab_capacity: int, needed_capacity: int) -> bool:
    return slab_capacity > SHED_OVER * needed_capacity and slab_capacity - needed_capacity >= SHED_MIN


def _capacity_for(nbytes: int) -> int:
    """A new slab's capacity for a request of `nbytes`: the growth margin, whole pages."""
    return _round_up(max(int(nbytes * GROWTH), 1), PAGE)


def slab_bytes(sizes: list[int]) -> int:
    """Bytes a slab needs to carve tensors of these byte sizes (alignment included)."""
    return sum(_round_up(s, ALIGN) for s in sizes)


class HostBufferPool:
    """Slabs lent to snapshots and given back by the writer; see the module docstring."""

    def __init__(self, keep_bytes: int, nice: int = 0, pin_for: torch.device | None = None) -> None:
        self.keep_bytes = keep_bytes
        self.nice = nice  # added to the niceness of the thread that reserves ahead
        # a CUDA device: slabs are page-locked for its asynchronous copies, registered with that
        # device current (the helper thread would otherwise make a context on device 0)
        self.pin_for = pin_for if pin_for is not None and pin_for.type == "cuda" else None
        self._free: list[Slab] = []
        self._lent = 0  # capacity of the slabs lent and not given back
        self._lock = threading.Lock()
        self._ahead: ThreadPoolExecutor | None = None
        self.allocated = 0  # slabs made (a figure for tests and benchmarks)
        self.held_peak = 0  # the most slab capacity held at once, lent and free (a figure for benchmarks)
        self.shed = 0  # free slabs a reserve found oversized and unmapped (a figure for tests)
        self.grown = 0  # free slabs a reserve grew in place instead of making a new one (a figure for tests)

    def lend(self, nbytes: int) -> Slab:
        """The smallest free slab that holds `nbytes`, or a new one."""
        with self._lock:
            fits = self._fitting(nbytes)
            if fits:
                slab = min(fits, key=lambda s: s.capacity)
                self._free.remove(slab)
                slab.reset()
                slab.fresh = False
            else:
                self.allocated += 1
                slab = Slab(_capacity_for(nbytes))
                if self.pinned:
                    self._pin(slab)
            self._lent += slab.capacity
            self._note_held()
            return slab

    @property
    def pinned(self) -> bool:
        return self.pin_for is not None

    def _pin(self, slab: Slab) -> None:
        with torch.cuda.device(self.pin_for):
            slab.pin()

    def _fitting(self, nbytes: int) -> list[Slab]:
        return [s for s in self._free if s.capacity >= nbytes]

    def give_back(self, slab: Slab) -> None:
        """Keep `slab` for a later snapshot if it fits within ``keep_bytes`` with the rest."""
        with self._lock:
            self._lent -= slab.capacity
            self._keep(slab)

    def _note_held(self) -> None:
        self.held_peak = max(self.held_peak, self._lent + sum(s.capacity for s in self._free))

    def _keep(self, slab: Slab) -> None:
        room, kept = self.keep_bytes - self._lent, []
        for s in sorted([*self._free, slab], key=lambda s: s.capacity, reverse=True):
            if s.capacity <= room:  # the largest that still fit: the most memory reused
                kept.append(s)
                room -= s.capacity
        self._free = kept

    def reserve(self, nbytes: int) -> bool:
        """Make sure a later `lend(nbytes)` finds a free slab whose pages are mapped: make one
        as `lend` would size it and fault it in, unless a free slab holds `nbytes` already or
        the slabs lent leave no room for it within ``keep_bytes``. Whether it made one.
        `nbytes` is the largest snapshot the policy may take next, so a free slab far larger
        (`_oversized`: a full checkpoint's, when only deltas follow) is unmapped first: a
        rank's steady state holds the memory its deltas need, not a whole copy of its rows."""
        capacity = _capacity_for(nbytes)
        with self._lock:
            oversized = [s for s in self._free if _oversized(s.capacity, capacity)]
            if oversized:  # kept for a snapshot larger than any the policy may take next: unmapped now
                self._free = [s for s in self._free if not _oversized(s.capacity, capacity)]
                self.shed += len(oversized)
            del oversized
            if self._fitting(nbytes) or capacity > self.keep_bytes - self._lent:
                return False
            # the largest free slab grows in place (a pinned pool's stay: their registration is fixed)
            candidate = None if self.pinned else max(self._free, key=lambda s: s.capacity, default=None)
            if candidate is not None:
                self._free.remove(candidate)  # not lent while it grows
        grown = candidate is not None and candidate.grow(capacity)
        if candidate is not None and not grown:
            with self._lock:
                self._keep(candidate)
        # made (or grown) and faulted in outside the lock: `lend` never waits for it
        slab = candidate if grown and candidate is not None else Slab(capacity, huge=True)
        slab.fault_in()
        if self.pinned:
            self._pin(slab)  # after the faults, which huge pages make cheaper
        with self._lock:
            if grown:
                self.grown += 1
            else:
                self.allocated += 1
            self._keep(slab)
            self._note_held()
        return True

    def reserve_ahead(self, nbytes: int) -> None:
        """`reserve(nbytes)` on the pool's helper thread (started on first use, at the pool's
        `nice`), so the training thread goes on at once."""
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="deltarec-host-buffers", initializer=self._lower_priority)
        self._ahead.submit(self.reserve, nbytes).add_done_callback(_log_failure)

    def _lower_priority(self) -> None:
        try:
            lower_thread_priority(self.nice)
        except OSError as exc:  # a sandbox may forbid it; reserving still works
            logger.debug("host buffer helper: cannot lower its priority: %s", exc)

    def close(self) -> None:
        """Wait for a reserve under way and stop the helper thread."""
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
            self._ahead = None

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.capacity for s in self._free)


def _log_failure(done: Future[bool]) -> None:
    if done.exception() is not None:  # the next snapshot makes its own slab, as without reserving
        logger.warning("reserving host memory for the next snapshot failed: %s", done.exception())
