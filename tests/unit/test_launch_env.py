"""Launcher detection (torchrun, srun, lone process) and the torchrun wrapper's command."""

from __future__ import annotations

import sys

from launch.torchrun import build_command
from sharding.process_group import detect_env


def test_torchrun_variables() -> None:
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (3, 8, 1, 2, "torchrun")
    assert env.num_nodes == 4


def test_slurm_variables_without_torchrun() -> None:
    env = detect_env(
        {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NUM_NODES": "2",
         "SLURM_NTASKS_PER_NODE": "8(x2)"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (9, 16, 1, 8, "slurm")


def test_torchrun_wins_over_slurm() -> None:
    env = detect_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env.launcher == "torchrun" and env.rank == 1


def test_lone_process() -> None:
    env = detect_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


def test_wrapper_builds_torchrun_command() -> None:
    cmd = build_command(["--nproc-per-node", "4", "--max-restarts", "2", "--config", "c.yaml", "train.steps=5"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--max-restarts=2" in cmd and "--standalone" in cmd
    assert cmd[-5:] == ["-m", "trainer.main", "--config", "c.yaml", "train.steps=5"]
