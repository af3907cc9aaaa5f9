"""HostBufferPool: snapshots reuse the memory of written ones, within the pending-snapshot budget."""

from __future__ import annotations

import torch

from ckpt.host_buffers import ALIGN, PAGE, HostBufferPool, slab_bytes


def test_carved_tensors_are_aligned_disjoint_and_typed() -> None:
    pool = HostBufferPool(1 << 30)
    slab = pool.lend(slab_bytes([3 * 5 * 4, 3 * 8, 7 * 2]))
    a = slab.carve((3, 5), torch.float32)
    b = slab.carve((3,), torch.int64)
    c = slab.carve((7,), torch.float16)
    assert (a.shape, a.dtype, b.shape, b.dtype, c.shape, c.dtype) == ((3, 5), torch.float32, (3,), torch.int64, (7,), torch.float16)
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
