"""The devices a test can run on: CPU always, CUDA as a visible skip where there is no GPU.

A test parametrized with `DEVICES` runs its CUDA case under the `gpu` marker (setup.cfg), so
`pytest -m gpu` selects exactly the tests that need a GPU, and a machine without one lists
them as skipped ("needs CUDA") instead of leaving them out silently.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA], id="cuda")
DEVICES = ["cpu", CUDA]


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
