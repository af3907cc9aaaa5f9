"""The records and the error more than one of ckpt/'s stages shares, defined before the stages
(torchrec's `types.py` idiom); each stage's own records and errors live beside it (`SinkError` in
ckpt/stream/sink.py, `MarkerError` in ckpt/log/markers.py, `Decision` in ckpt/save/policy.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from common.errors import DeltarecError


class RestoreError(DeltarecError, RuntimeError):
    """The checkpoint cannot be restored as recorded; the message says where and why."""


class JobIdentity(NamedTuple):
    """What ties a checkpoint to the job that wrote it (stored in every dense file)."""

    config_sha256: str  # the resolved job config
    model_sha256: str  # the model section: what rows and dense state depend on


@dataclass
class ChainState:
    """Where this rank's chain of checkpoints stands: what the next checkpoint is numbered and
    builds on. A restore sets it (`Resumed`), every checkpoint taken and every outcome moves it."""

    next_id: int = 1  # the id the next checkpoint gets
    generation: int = 0  # the checkpoint that opened the chain (a full one, or the first delta after a restore)
    ids: list[int] = field(default_factory=list)  # the links a restore of the newest checkpoint replays
    force_full: bool = False  # the next checkpoint must be full: after a failure, a restore, a prioritized run
    last_committed: int = 0  # the newest checkpoint this rank knows committed (restored or written)
    restores: int = 0  # restores of this job so far (persisted in the dense state)
    lost_samples: float = 0.0  # samples whose updates partial recoveries lost, over the run
    coalesced: int = 0  # checkpoints coalesced in a row since the last one taken (`ckpt.write.max_coalesced`)
