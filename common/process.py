"""How a deltarec command's process runs and exits: `run_main`.

A process that imported torch, torchrec and torchmetrics holds some 400k objects the garbage
collector tracks. A full collection walks all of them, and the interpreter's exit collects
while it tears the modules down: seconds of CPU per process after its work is done, on every
rank of every job and restart (docs/design/environment.md, "The garbage collector and a process's
exit"). `gc.freeze()` moves the objects alive at that moment into a generation no collection
visits; they are still freed by reference counting, and only cyclic garbage among them is
left to the OS at exit.

The exit itself skips the interpreter's teardown (`leave`): torch.distributed's gloo threads
outlive `destroy_process_group` (docs/design/environment.md, "A rank's exit"), and one that needs
the GIL while the interpreter finalizes aborts the process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Exit with `main()`'s code (None: 0): the imports' objects frozen before it runs (collections
    during the job skip them), and whatever is alive after it frozen too (the exit does not
    walk it). The exit is `leave`'s. An exception leaves as it would without this."""
    gc.freeze()
    code = main()
    gc.freeze()
    leave(0 if code is None else code)


def leave(code: int) -> NoReturn:
    """Exit with `code` as the interpreter's exit would, less its teardown of the modules.

    First what a normal exit does while the interpreter is whole, in its order: threading's
    shutdown (its exit callbacks, which stop concurrent.futures' idle workers, then a join of
    every thread that is not a daemon), the exit handlers (`atexit`: logging's flush,
    multiprocessing's children), a flush of Python's and C's standard streams. Then `os._exit`.
    Why: torch keeps references to the default process group that `destroy_process_group`
    does not drop, so gloo's worker threads outlive it; a worker that lets go of a finished
    collective whose tensors Python made, or runs a future's Python callback, takes the GIL,
    and a thread that takes it while the interpreter finalizes is ended by `pthread_exit`
    through a C++ frame that may not unwind: "terminate called without an active exception"
    and SIGABRT, after the job's work was done (docs/design/environment.md, "A rank's exit"). Nothing
    deltarec writes depends on a finalizer: files and clients are closed explicitly."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own first step of its exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed or replaced by something that cannot flush
            stream.flush()
    ctypes.CDLL(None).fflush(None)  # what C and C++ code wrote to stdio's buffers
    os._exit(code)
