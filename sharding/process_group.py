"""Process-group set-up in one place: who am I (torchrun, srun or a lone process) and which backend.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; srun without torchrun
exports SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; a plain process is rank 0 of 1.
nccl is used when CUDA is available, gloo otherwise.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common.errors import DeltarecError

logger = logging.getLogger(__name__)


class ProcessGroupError(DeltarecError, RuntimeError):
    """The ranks cannot form a group as configured (backend, launcher environment)."""


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "torchrun", "slurm" or "single"

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables; torchrun's win over slurm's when both are set."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return DistEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world, "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or max(1, world // nodes)
        return DistEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), local_world, "slurm")
    return DistEnv(0, 1, 0, 1, "single")


def pick_device(env: DistEnv) -> torch.device:
    """The local GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(env: DistEnv, *, backend: str = "auto", init_method: str = "env://", timeout_s: int = 300) -> torch.device:
    """Initialise torch.distributed for this process and return its compute device.

    A lone process gets a one-rank gloo group over a file rendezvous, so the same
    sharded code path (DMP, collectives) runs everywhere.
    """
    device = pick_device(env)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ProcessGroupError("sharding.backend=nccl needs CUDA, and no GPU is visible; use gloo or auto")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        # nccl carries only CUDA tensors; the checkpointer agrees on CPU counts and flags
        # (async all-reduces that must not wait on the training stream): gloo carries those
        backend = "cpu:gloo,cuda:nccl"
    if env.launcher == "single" and init_method == "env://":
        fd, path = tempfile.mkstemp(prefix="deltarec-rdzv-")
        os.close(fd)
        os.unlink(path)
        init_method = f"file://{path}"
    if env.launcher == "slurm" and init_method == "env://":
        _slurm_rendezvous_defaults()
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if init_method == "env://" and attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's shared store outlives an attempt: without a per-attempt prefix a restarted
        # rank reads the dead attempt's gloo addresses and cannot connect. On several nodes the
        # agents' restart counts can differ (a failure on one, a membership change on another),
        # which is why deltarec-launch and the sbatch template turn sharing off (a fresh store
        # per attempt, no prefix needed); see docs/design/environment.md, "torchrun's stores".
        store, _, _ = next(dist.rendezvous(init_method, rank=env.rank, world_size=env.world_size, timeout=timeout))
        store = dist.PrefixStore(f"deltarec/attempt{attempt}/", store)
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    if env.rank == 0:
        logger.info("process group: %s, %d ranks (%s), device %s", backend, env.world_size, env.launcher, device)
    return device


def _slurm_rendezvous_defaults() -> None:
    """srun without torchrun: the sbatch script must export MASTER_ADDR; derive a port."""
    if "MASTER_ADDR" not in os.environ:
        raise ProcessGroupError(
            "running under srun without torchrun needs MASTER_ADDR (the first node's address); "
            "launch/slurm/deltarec.sbatch exports it, or use torchrun per node"
        )
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def destroy_process_group(clean: bool = True) -> None:
    """Tear down the group if one is up (safe to call twice).

    After a clean run every rank meets at a barrier first: gloo aborts the process
    ("terminate called without an active exception") when a rank tears down while a
    peer still has a collective in flight. After an error, skip the barrier (peers may
    be gone) and let the launcher reap the job. The group's threads outlive this (torch keeps
    references to the group): the process must leave through `common.process.leave`, or
    one of them may abort its exit (docs/design/environment.md, "A rank's exit").
    """
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
