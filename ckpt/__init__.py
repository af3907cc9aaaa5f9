"""deltarec's continuous checkpoints. The public API, for a user's own TorchRec loop:

    from ckpt import Checkpointer, CkptConfig, initialise_rows, load_ckpt_config

(ckpt/checkpointer.py; the stages it drives, in order: docs/design/layers.md). Imported on first
use, so `import ckpt.events` and the command-line tools do not pay for the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "ckpt.checkpointer",
    "initialise_rows": "ckpt.build",
    "CkptConfig": "ckpt.config",
    "SinkConfig": "ckpt.config",
    "ScheduleConfig": "ckpt.config",
    "WriteConfig": "ckpt.config",
    "EncodingConfig": "ckpt.config",
    "CaptureConfig": "ckpt.config",
    "RestoreConfig": "ckpt.config",
    "RecoveryConfig": "ckpt.config",
    "FollowConfig": "ckpt.config",
    "load_ckpt_config": "ckpt.config",
    "RestoreReport": "ckpt.restore.restorer",
    "RestoreError": "ckpt.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
