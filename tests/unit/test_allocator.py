"""The training process's C allocator settings (trainer/allocator.py): with them, memory a
step frees is reused by the next step instead of being given back and faulted in again; a
value the user set in the environment wins. Each case runs in a fresh interpreter, whose
allocator nothing else has touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch.ranks import REPO

# Steps that each allocate six 3 MiB blocks, write them, and free them all: glibc's defaults
# trim the freed heap top each time (its trim threshold follows the mmap threshold to 6 MiB),
# so every step faults its 18 MiB in again.
_STEPS = """
import json, resource, sys
from trainer.allocator import keep_freed_memory
done = keep_freed_memory() if sys.argv[1] == "keep" else []
def step():
    blocks = [b"\\1" * (3 << 20) for _ in range(6)]
    return sum(b[-1] for b in blocks)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "set": done}))
"""

glibc = pytest.mark.skipif(not (hasattr(os, "confstr") and os.confstr("CS_GNU_LIBC_VERSION")), reason="needs glibc")


def _run(mode: str, env: dict[str, str] | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


@glibc
def test_memory_a_step_frees_is_reused_by_the_next_step_instead_of_faulted_in_again() -> None:
    default, kept = _run("default"), _run("keep")
    assert kept["set"] == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"]
    assert default["faults"] > 20 * 18 * 256 // 2, default  # at least half of every step's 4 KiB pages
    assert kept["faults"] < default["faults"] / 20, (kept, default)


@glibc
def test_a_setting_the_user_made_in_the_environment_wins() -> None:
    got = _run("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert got["set"] == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"]


# One rank builds its job (`trainer.main.build_job`, what every trainer rank runs) with
# `train.keep_freed_memory` as given; prints whether the allocator settings were applied.
_BUILD = """
import json, sys
import trainer.main as main
from sharding.process_group import destroy_process_group, detect_env, init_process_group
from trainer.config import load_config
from trainer.metrics import MetricsLog
calls = []
main.keep_freed_memory = lambda: calls.append(1) or []
cfg = load_config(sys.argv[1], [f"train.keep_freed_memory={sys.argv[2]}", f"run.dir={sys.argv[4]}"])
env = detect_env()
device = init_process_group(env, backend="gloo", init_method=f"file://{sys.argv[3]}", timeout_s=60)
job = main.build_job(cfg, env, device, MetricsLog(cfg.run.run_dir / "metrics.jsonl", enabled=False))
del job
destroy_process_group()
print(json.dumps({"calls": len(calls)}))
"""


@pytest.mark.parametrize("keep", ["true", "false"])
def test_a_rank_keeps_freed_memory_unless_its_config_says_not(keep: str, tmp_path, debug_config) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _BUILD, str(debug_config.path), keep, str(tmp_path / "rdzv"), str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"calls": 1 if keep == "true" else 0}


# A burst in another thread (its own malloc arena) frees 125 MiB of 64 KiB blocks but keeps
# one in 50, so no arena's top is free and nothing goes back by itself; then the trim.
_BURST = """
import json, sys, threading
from common.allocator import give_back_freed_memory
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
kept = []
def burst():
    blocks = [bytearray(64 << 10) for _ in range(2000)]
    kept.extend(blocks[::50])
t = threading.Thread(target=burst)
t.start()
t.join()
before = anon()
done = give_back_freed_memory() if sys.argv[1] == "trim" else False
print(json.dumps({"done": done, "freed": before - anon()}))
"""


def _burst(mode: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _BURST, mode], cwd=REPO, env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@glibc
def test_memory_a_burst_freed_goes_back_to_the_kernel_when_given_back() -> None:
    idle, trimmed = _burst("none"), _burst("trim")
    assert not idle["done"] and trimmed["done"], (idle, trimmed)
    assert idle["freed"] < 8 << 20, idle  # freed blocks stay resident on their own
    assert trimmed["freed"] > 64 << 20, trimmed  # most of the 122 MiB freed is returned
