"""HostBufferPool: snapshots reuse the memory of written ones, within the pending-snapshot budget."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from ckpt.capture.host_buffers import ALIGN, OS_PAGE, PAGE, HostBufferPool, slab_bytes
from ckpt.save.schedule import grown_estimate


def test_carved_tensors_are_aligned_disjoint_and_typed() -> None:
    pool = HostBufferPool(1 << 30)
    slab = pool.lend(slab_bytes([3 * 5 * 4, 3 * 8, 7 * 2]))
    a = slab.carve((3, 5), torch.float32)
    b = slab.carve((3,), torch.int64)
    c = slab.carve((7,), torch.float16)
    assert (a.shape, a.dtype, b.shape, b.dtype, c.shape, c.dtype) == (
        (3, 5),
        torch.float32,
        (3,),
        torch.int64,
        (7,),
        torch.float16,
    )
    assert all(t.is_contiguous() and t.data_ptr() % ALIGN == 0 for t in (a, b, c))
    a.fill_(1.0), b.fill_(-1), c.fill_(2.0)
    assert a.sum().item() == 15.0 and b.sum().item() == -3 and c.sum().item() == 14.0  # no overlap
    assert slab.capacity % PAGE == 0 and slab.capacity >= slab_bytes([60, 24, 14])


def test_a_given_back_slab_is_lent_again_and_the_smallest_that_fits_wins() -> None:
    pool = HostBufferPool(1 << 30)
    big, small = pool.lend(10 * PAGE), pool.lend(PAGE // 2)
    pool.give_back(big)
    pool.give_back(small)
    assert pool.lend(PAGE // 4) is small  # the smallest that fits
    again = pool.lend(9 * PAGE)
    assert again is big and pool.allocated == 2
    assert pool.lend(20 * PAGE) not in (big, small) and pool.allocated == 3  # none fits: a new one


def test_kept_memory_never_exceeds_the_budget_with_the_slabs_still_lent() -> None:
    pool = HostBufferPool(keep_bytes=8 * PAGE)
    a, b = pool.lend(3 * PAGE), pool.lend(3 * PAGE)  # 4 pages each with the growth margin
    pool.give_back(a)
    assert pool.free_bytes == a.capacity  # 4 lent + 4 free = 8 pages: within the budget
    c = pool.lend(PAGE)
    assert c is a  # reused
    pool.give_back(b)
    pool.give_back(c)
    assert pool.free_bytes == 8 * PAGE
    huge = pool.lend(16 * PAGE)  # bigger than the budget: lent, but not kept once given back
    pool.give_back(huge)
    assert huge.capacity > 8 * PAGE and pool.free_bytes == 8 * PAGE  # the two that fit stay
    assert pool.lend(PAGE) in (a, b) and pool.allocated == 3


def _resident(t: torch.Tensor) -> float:
    """The fraction of `t`'s 4 KiB pages that are mapped (mincore(2))."""
    start, end = t.data_ptr() & ~(OS_PAGE - 1), t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(end - start) // OS_PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def test_a_reserved_slab_is_faulted_in_and_lent_to_the_snapshot_it_was_sized_for() -> None:
    pool = HostBufferPool(1 << 30)
    assert pool.reserve(40 * PAGE)
    slab = pool.lend(40 * PAGE)
    assert slab.capacity >= 40 * PAGE and pool.allocated == 1
    fresh = HostBufferPool(1 << 30).lend(40 * PAGE)  # what the stall faulted in without it
    assert _resident(slab.buffer) == 1.0 and _resident(fresh.buffer) == 0.0
    fresh.buffer.fill_(1)
    assert _resident(fresh.buffer) == 1.0  # written: the check sees the pages a snapshot maps
    assert pool.lend(PAGE) is not slab  # lent: a new one


def test_reserve_does_nothing_when_a_free_slab_fits_or_the_budget_has_no_room() -> None:
    pool = HostBufferPool(keep_bytes=10 * PAGE)
    a = pool.lend(4 * PAGE)  # 5 pages with the growth margin
    pool.give_back(a)
    assert not pool.reserve(4 * PAGE) and pool.allocated == 1  # `a` holds it
    lent = pool.lend(4 * PAGE)
    assert lent is a
    assert not pool.reserve(6 * PAGE) and pool.allocated == 1  # 8 pages beside the 5 lent: over 10
    assert pool.reserve(3 * PAGE) and pool.free_bytes == 4 * PAGE  # 4 pages fit beside the 5 lent


def test_reserve_ahead_runs_on_the_helper_thread_and_close_waits_for_it() -> None:
    pool = HostBufferPool(1 << 30, nice=5)
    pool.reserve_ahead(8 * PAGE)
    pool.close()
    assert pool.allocated == 1 and pool.free_bytes >= 8 * PAGE
    assert pool.lend(8 * PAGE).capacity >= 8 * PAGE and pool.allocated == 1


def test_the_next_snapshot_is_sized_by_each_kinds_growth_and_capped_at_every_row() -> None:
    previous = {"full": 100, "base": 10, "last": 10}
    now = {"full": 150, "base": 40, "last": 5}
    assert grown_estimate(previous, now, ("full", "base"), cap=1000) == 200  # 150 + 50
    assert grown_estimate(previous, now, ("base",), cap=1000) == 70
    assert grown_estimate(previous, now, ("last",), cap=1000) == 5  # shrinking: not below now
    assert grown_estimate({}, now, ("full",), cap=1000) == 300  # the first: taken to double
    assert grown_estimate({"full": 100}, now, ("full", "base"), cap=1000) == 200  # base after a new baseline: 80
    assert grown_estimate(previous, now, ("full",), cap=180) == 180


def test_only_a_slab_lend_had_to_make_is_fresh_one_reused_or_reserved_is_not() -> None:
    """`Slab.fresh` is what a snapshot reports as host memory allocated inside its stall."""
    pool = HostBufferPool(keep_bytes=64 * PAGE)
    made = pool.lend(PAGE)
    assert made.fresh
    pool.give_back(made)
    again = pool.lend(PAGE)
    assert again is made and not again.fresh
    assert pool.reserve(8 * PAGE)
    reserved = pool.lend(8 * PAGE)
    assert reserved is not made and not reserved.fresh


def _vm_flags(t: torch.Tensor) -> set[str]:
    """The kernel's flags of the mapping that holds `t` (/proc/self/smaps, `VmFlags`)."""
    addr, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").is_dir(), reason="needs a kernel with THP")
def test_only_a_slab_mapped_ahead_asks_for_huge_pages() -> None:
    """VmFlags "hg" is MADV_HUGEPAGE: a reserved slab is mapped off the stall, where huge pages cost less
    CPU; a slab `lend` makes is faulted in by the stall's copy, which fresh huge pages slowed."""
    pool = HostBufferPool(1 << 30)
    assert pool.reserve(4 * PAGE)
    reserved = pool.lend(4 * PAGE)
    made = pool.lend(4 * PAGE)  # the reserved one is lent: a new one
    assert made is not reserved and made.fresh and not reserved.fresh
    assert "hg" in _vm_flags(reserved.buffer) and "hg" not in _vm_flags(made.buffer)


def test_held_peak_is_the_most_capacity_held_at_once_lent_and_free() -> None:
    pool = HostBufferPool(1 << 30)
    a, b = pool.lend(3 * PAGE), pool.lend(5 * PAGE)
    both = a.capacity + b.capacity
    assert pool.held_peak == both
    pool.give_back(a)
    pool.give_back(b)
    assert pool.lend(2 * PAGE) is a and pool.held_peak == both  # reused: nothing more held
    pool.give_back(a)
    c = pool.lend(40 * PAGE)  # none fits: a third slab beside the two kept
    assert pool.held_peak == both + c.capacity


def test_a_reserve_for_a_much_smaller_snapshot_unmaps_the_full_checkpoints_slab() -> None:
    from ckpt.capture.host_buffers import SHED_MIN

    pool = HostBufferPool(1 << 32)
    full = pool.lend(4 * SHED_MIN)  # a full checkpoint's rows
    pool.give_back(full)
    assert pool.free_bytes == full.capacity  # kept: the next snapshot may be full again
    assert pool.reserve(SHED_MIN // 2) is True  # the policy's next snapshots are deltas: a small slab
    assert pool.shed == 1 and pool.free_bytes < full.capacity // 2
    delta = pool.lend(SHED_MIN // 2)
    assert delta is not full and not delta.fresh  # the reserved slab, faulted in ahead
    pool.give_back(delta)
    assert pool.reserve(4 * SHED_MIN) is True and pool.shed == 1  # a full one ahead: the small one grown to it
    assert pool.grown == 1 and pool.free_bytes >= 4 * SHED_MIN
    assert pool.reserve(SHED_MIN // 2) is True and pool.shed == 2  # deltas again: the big one goes, a small one made


def test_a_reserve_keeps_slabs_a_little_larger_than_asked() -> None:
    pool = HostBufferPool(1 << 30)
    a = pool.lend(10 * PAGE)
    pool.give_back(a)
    assert pool.reserve(4 * PAGE) is False and pool.shed == 0  # over twice as large, but not by 64 MiB
    assert pool.lend(4 * PAGE) is a


def test_a_reserve_for_a_larger_snapshot_grows_the_free_slab_where_it_is() -> None:
    """The trained rows grow through a job, so each full checkpoint is larger than the last: the
    slab grows in place (its mapped pages stay, only the new ones are mapped), not a new one."""
    pool = HostBufferPool(1 << 30)
    slab = pool.lend(4 * PAGE)
    t = slab.carve((4 * PAGE // 8,), torch.int64)
    t.copy_(torch.arange(t.numel()))
    old_capacity = slab.capacity
    del t
    pool.give_back(slab)
    assert pool.reserve(20 * PAGE) is True
    assert (pool.grown, pool.allocated) == (1, 1) and pool.free_bytes >= 20 * PAGE
    grown = pool.lend(20 * PAGE)
    assert grown is slab and grown.capacity > old_capacity and not grown.fresh
    kept = grown.carve((4 * PAGE // 8,), torch.int64)
    assert torch.equal(kept, torch.arange(kept.numel()))  # the same memory: the rows written before are there
    rest = grown.carve(((grown.capacity - 4 * PAGE) // 8,), torch.int64)
    rest.fill_(7)  # every new page is writable
    assert int(rest[-1]) == 7


@pytest.mark.parametrize("holder", ["carved tensor", "view of a slice", "numpy array"])
def test_a_slab_something_still_points_into_is_not_remapped(holder: str) -> None:
    pool = HostBufferPool(1 << 30)
    slab = pool.lend(4 * PAGE)
    carved = slab.carve((16,), torch.float32)
    carved.fill_(3.0)
    alive = {"carved tensor": carved, "view of a slice": carved[4:].view(torch.int32), "numpy array": carved.numpy()}[holder]
    del carved
    pool.give_back(slab)
    assert pool.reserve(20 * PAGE) is True
    assert (pool.grown, pool.allocated) == (0, 2)  # a new slab beside it
    expected = torch.tensor(3.0).view(torch.int32).item() if holder == "view of a slice" else 3.0
    assert slab.capacity < 20 * PAGE and alive[-1].item() == expected  # untouched, where it was
