"""Warm rank starts (launch/warm.py): a forked child behaves as the cold `python` it replaces.

Each test starts real processes through launch/ranks.py's `start_command` (the suite turns warm
starts on in tests/conftest.py) and checks what the program saw and what the caller got back:
its argv, environment, working directory, stdin, output files, and exit status as Popen
reports it (a normal exit, `sys.exit(n)`, an uncaught exception, a SIGKILL from outside).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from launch import warm
from launch.ranks import start_command

PROGRAM = textwrap.dedent(
    """
    import json, os, sys
    preloaded = "torch" in sys.modules  # before this program imports anything heavy
    print(json.dumps({"preloaded": preloaded, "argv": sys.argv, "rank": os.environ.get("RANK"),
                      "marker": os.environ.get("WARM_TEST_MARKER"), "cwd": os.getcwd(), "path0": sys.path[0],
                      "stdin": sys.stdin.read(), "name": __name__}))
    print("to stderr", file=sys.stderr)
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "raise":
        raise ValueError("raised on purpose")
    if what == "sleep":
        import time
        time.sleep(600)
    sys.exit(int(what) if what.isdigit() else 0)
    """
)


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    return path


def _seen(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[0])


def test_the_suite_starts_ranks_warm():
    assert warm.enabled(), "tests/conftest.py turns warm starts on"


def test_a_forked_rank_sees_its_argv_environment_files_and_an_empty_stdin(tmp_path, program):
    group = start_command([sys.executable, str(program), "7"], tmp_path, world_size=2,
                          env_extra={"WARM_TEST_MARKER": "m1"})  # fmt: skip
    results = group.wait(expect_ok=False)
    assert all(isinstance(p, warm.WarmProcess) for p in group.procs)
    for rank, result in enumerate(results):
        seen = _seen(result)
        assert seen["preloaded"], "torch imported before the program ran: the rank was forked warm"
        assert seen["argv"] == [str(program), "7"]
        assert (seen["rank"], seen["marker"]) == (str(rank), "m1")
        assert seen["cwd"] == str(warm.REPO)
        assert seen["path0"] == str(program.parent), "a script's directory leads sys.path, as with `python script.py`"
        assert seen["stdin"] == "" and seen["name"] == "__main__"
        assert result.stderr == "to stderr\n"
        assert result.returncode == 7


def test_an_uncaught_exception_exits_1_with_its_traceback(tmp_path, program):
    (result,) = start_command([sys.executable, str(program), "raise"], tmp_path, world_size=1).wait(expect_ok=False)
    assert result.returncode == 1
    assert "ValueError: raised on purpose" in result.stderr.splitlines()[-1]


def test_a_sigkill_from_outside_reads_as_minus_9_and_wait_times_out_before(tmp_path, program):
    group = start_command([sys.executable, str(program), "sleep"], tmp_path, world_size=1)
    (proc,) = group.procs
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # a reaped rank is never signalled again: no error, no stray signal
    assert proc.poll() == -signal.SIGKILL


def test_a_module_runs_as_main_with_its_file_as_argv0(tmp_path):
    (result,) = start_command([sys.executable, "-m", "trainer.main", "--help"], tmp_path, world_size=1).wait()
    assert result.stdout.startswith("usage: deltarec-train")


def test_another_thread_count_or_interpreter_flag_starts_cold(tmp_path, program):
    cold_env = start_command([sys.executable, str(program)], tmp_path, world_size=1, env_extra={"OMP_NUM_THREADS": "2"})
    cold_flag = start_command([sys.executable, "-X", "utf8", str(program)], tmp_path, world_size=1)
    for group in (cold_env, cold_flag):
        assert isinstance(group.procs[0], subprocess.Popen)
        (result,) = group.wait()
        assert not _seen(result)["preloaded"]
