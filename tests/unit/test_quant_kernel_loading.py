"""When the fused adaptive kernel is loaded jitted (importing numba costs ~2 s), and the summation
order that makes its bytes the torch reference's. The kernel's bytes themselves:
test_quant_adaptive_kernel.py; the module built at setup, which loads no numba at all:
test_compiled_kernels.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ckpt.quant import warm_up_codecs
from ckpt.quant.adaptive import row_sum
from common import compiled


def test_numba_is_imported_only_by_a_process_that_encodes_adaptive_rows_jitted():
    # with the built modules off: a job checkpointing fp32 or asym4, or one that only decodes
    # adaptive rows, must not pay it
    code = (
        "import sys; from ckpt.quant import warm_up_codecs, get_codec; import torch\n"
        "warm_up_codecs(['fp32', 'asym4']); get_codec('adaptive4').decode(torch.zeros(1, 8, dtype=torch.uint8), 8)\n"
        "print('numba' in sys.modules)\n"
        "warm_up_codecs(['adaptive4']); print('numba' in sys.modules)\n"
    )
    env = {**os.environ, compiled.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env)
    assert out.stdout.split() == ["False", str(importlib.util.find_spec("numba") is not None)]


def test_warm_up_names_only_known_codecs():
    with pytest.raises(ValueError, match="unknown codec"):
        warm_up_codecs(["adaptive9"])


def test_row_sum_adds_in_element_order():
    # 1 + 2**-24 rounds to 1 in fp32: the order of the additions decides the result
    x = torch.tensor([[1.0, 2.0**-24, 2.0**-24], [2.0**-24, 2.0**-24, 1.0]])
    assert row_sum(x).tolist() == [1.0, 1.0 + 2.0**-23]
