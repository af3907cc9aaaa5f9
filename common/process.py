"""How a deltarec command's process runs and exits: `run_main`.

A process that imported torch, torchrec and torchmetrics holds some 400k objects the garbage
collector tracks. A full collection walks all of them, and the interpreter's exit collects
while it tears the modules down: seconds of CPU per process after its work is done, on every
rank of every job and restart (docs/design.md §8, "The garbage collector and a process's
exit"). `gc.freeze()` moves the objects alive at that moment into a generation no collection
visits; they are still freed by reference counting, and only cyclic garbage among them is
left to the OS at exit.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import NoReturn


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Exit with `main()`'s code (None: 0): the imports' objects frozen before it runs (collections
    during the job skip them), and whatever is alive after it frozen too (the exit does not
    walk it). An exception leaves as it would without this."""
    gc.freeze()
    code = main()
    gc.freeze()
    sys.exit(code)
