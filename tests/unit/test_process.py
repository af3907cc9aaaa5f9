"""`common.process.run_main`: a command's exit code, its imports kept out of the collector's
walks during the run, cyclic garbage made during the run still collected, errors unchanged.
Each case runs in a process of its own (the freeze would otherwise stay in pytest's)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO


def _run(body: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_the_exit_code_is_mains_and_what_was_imported_is_frozen_before_it_runs() -> None:
    done = _run(
        """
        import gc, json
        from common.process import run_main

        def main():
            print(gc.get_freeze_count())
            return 3

        run_main(main)
        """
    )
    assert done.returncode == 3, done.stderr
    assert int(done.stdout.split()[0]) > 1000  # json, gc, the interpreter's own modules at least


def test_cycles_made_during_the_run_are_still_collected() -> None:
    done = _run(
        """
        import gc, weakref
        from common.process import run_main

        class Node:
            pass

        def main():
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle only the collector frees
            alive = weakref.ref(a)
            del a, b
            gc.collect()
            return 0 if alive() is None else 5

        run_main(main)
        """
    )
    assert done.returncode == 0, (done.returncode, done.stderr)


def test_an_exception_leaves_as_it_would_without_it() -> None:
    done = _run(
        """
        from common.process import run_main

        def main():
            raise RuntimeError("the job's own failure")

        run_main(main)
        """
    )
    assert done.returncode == 1
    assert "RuntimeError: the job's own failure" in done.stderr and "Traceback" in done.stderr


def test_the_exit_joins_threads_runs_exit_handlers_and_flushes_python_and_c_output() -> None:
    # `leave` skips the interpreter's teardown (os._exit): whatever a normal exit does before
    # it must still happen, or a job's last lines and its children's cleanup would be lost;
    # and an idle executor left open (as after a collective timed out) must not hold it up
    done = _run(
        """
        import atexit, ctypes, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from common.process import run_main

        POOL = ThreadPoolExecutor(1)  # held, never shut down: its worker waits for work

        def main():
            POOL.submit(print, "executor ran").result()
            atexit.register(print, "exit handler ran")
            threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
            print("python's buffer", end="")
            ctypes.CDLL(None).printf(b"C's buffer|")  # stdout is a pipe: C buffers it whole
            return 4

        run_main(main)
        """,
        # buffered, as by default: PYTHONUNBUFFERED would leave C's stdout unbuffered too
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
    )
    assert done.returncode == 4, done.stderr
    for line in ("executor ran", "python's buffer", "C's buffer|", "thread finished", "exit handler ran"):
        assert line in done.stdout, (line, done.stdout)
    assert done.stdout.index("thread finished") < done.stdout.index("exit handler ran")
