"""What reads the stream without a model (the follower, `deltarec-ckpt`) never imports torchrec,
whose import costs CPU and resident memory in every such process (docs/design/follower.md;
`sharding/shard_views.py` imports it on first use, by the ranks)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.ranks import REPO


@pytest.mark.parametrize("module", ["trainer.follow_cli", "trainer.ckpt_cli"])
def test_a_stream_reader_imports_without_torchrec(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torchrec', 'fbgemm_gpu') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
