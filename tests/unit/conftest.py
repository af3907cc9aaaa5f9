"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Small tensors: intra-op threads only add OpenMP barriers (and stall on a loaded 2-core box)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
