"""Stopping a rank so that it can keep its work (`ckpt.recovery.mode: partial`).

When one rank dies torchrun's agent sends SIGTERM to the others and SIGKILLs them 30 s later.
By default SIGTERM ends a rank at once; under partial recovery it only asks the loop to stop
after the step in progress, so the rank can save its survivor snapshot (ckpt/recovery/survivor.py) of
a completed step first. A rank whose collective fails because a peer died takes the same
path without a signal.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

from ckpt.checkpointer import Checkpointer
from trainer import console
from trainer.trainer import StopRequested, Trainer


class SigtermStopsLoop:
    """While held: SIGTERM sets `trainer.stop_requested` instead of ending the process."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        trainer.keep_step_start = True  # a survivor saves the state of its last completed step
        self.received = False
        self._previous: Any = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        self.trainer.stop_requested = True

    def release(self) -> None:
        """Restore the previous handler; a SIGTERM that came meanwhile now ends the process,
        as the agent that sent it expects."""
        signal.signal(signal.SIGTERM, self._previous)
        if self.received:
            os.kill(os.getpid(), signal.SIGTERM)


def keeps_work(exc: BaseException) -> bool:
    """Whether `exc` ended this rank's loop because another rank failed (so this one survived)."""
    return isinstance(exc, StopRequested) or console.is_peer_lost(exc)


def save_survivor(manager: Checkpointer, trainer: Trainer, rank: int) -> None:
    """Save this surviving rank's snapshot; a failure is one line, never a second traceback
    (the restore then rolls this rank's shards back too)."""
    try:
        record = manager.save_survivor(trainer.completed_state())
    except Exception as exc:  # noqa: BLE001 - the rank is exiting anyway; the job restarts without it
        console.say(f"deltarec-train: rank {rank}: survivor snapshot not saved (its shards will roll back): {exc}", err=True)
        return
    if record is not None:
        console.say(
            f"deltarec-train: rank {rank} saved its survivor snapshot: step {record.step}, "
            f"{record.link.rows:,} rows changed since checkpoint {record.base}, {record.link.bytes / 1e6:.2f} MB",
            err=True,
        )
