"""Warm rank starts: ranks forked from one process that imported torch and torchrec already.

A cold `python -m trainer.main` spends seconds importing torch and torchrec before it does
anything, and the test suite starts hundreds of ranks. With warm starts, the first start in a
process launches a server (`python -m launch.warm <fd>`) that imports `PRELOAD` once; every
start asks it over a Unix socket to fork, and the child becomes the requested program:
its argv, environment, working directory and stdout/stderr files (passed as descriptors), stdin
from /dev/null, then `runpy` runs the module or script as `__main__` and the interpreter exits
as a cold one would (atexit, exit status, an uncaught exception's traceback and status 1).

What differs from a cold start, and why it is acceptable where it is used (the tests): the
child's parent is the server (its exit status is read through it), its /proc cmdline and
environ are the server's (os.environ is the requested one), modules imported by the
server are shared rather than imported again (their import-time warnings are not repeated),
and every child shares the server's string-hash seed. torchrun, the README's commands and the
benchmarks' timings start ranks cold.

Only `python -m module ...` and `python script.py ...` with this very interpreter and the
server's `LOAD_TIME_ENV` are started warm; anything else (another interpreter, other flags,
another thread count) starts cold.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "torchrec", "trainer.main")
ENV_FLAG = "DELTAREC_WARM_RANKS"  # "1": start ranks warm (the test suite sets it)
# Read when the interpreter or torch loads: a child asking for other values than the server's starts cold.
LOAD_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "LD_PRELOAD", "LD_LIBRARY_PATH",
                 "CUDA_VISIBLE_DEVICES")  # fmt: skip
_MAX_MESSAGE = 1 << 20
_POLL_S = 0.02


def enabled() -> bool:
    """Whether this process starts ranks warm (`ENV_FLAG` is "1")."""
    return os.environ.get(ENV_FLAG) == "1"


@dataclass(frozen=True)
class Program:
    """What a warm child runs: a module (`python -m`) or a script, with its arguments."""

    module: str | None
    script: str | None
    args: tuple[str, ...]

    @classmethod
    def parse(cls, argv: Sequence[str]) -> Program | None:
        """The program of `argv`, or None where it is not this interpreter with `-m` or a script."""
        if len(argv) < 2 or argv[0] != sys.executable:
            return None
        if argv[1] == "-m" and len(argv) >= 3:
            return cls(argv[2], None, tuple(argv[3:]))
        if argv[1].endswith(".py"):
            return cls(None, argv[1], tuple(argv[2:]))
        return None


class WarmProcess:
    """A forked child seen like a `subprocess.Popen`: pid, returncode, poll, wait, kill."""

    def __init__(self, server: WarmServer, pid: int, args: Sequence[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid the server has reaped (it may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmServer:
    """The client side of one warm server process (see the module docstring)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._log = tempfile.NamedTemporaryFile("w+", prefix="deltarec-warm-", suffix=".err")
        self._env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "launch.warm", str(theirs.fileno())],
            cwd=REPO,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()

    def fits(self, env: Mapping[str, str]) -> bool:
        """Whether a child with `env` behaves as a cold start would: the same `LOAD_TIME_ENV` as the server."""
        return all(env.get(name) == self._env.get(name) for name in LOAD_TIME_ENV)

    def _ask(self, request: dict, fds: Sequence[int] = ()) -> dict:
        with self._lock:
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
                reply = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                reply = b""
        if not reply:
            self._log.seek(0)
            raise RuntimeError(f"the warm rank server (pid {self._proc.pid}) is gone:\n{self._log.read()[-3000:]}")
        return json.loads(reply)

    def start(self, program: Program, argv: Sequence[str], cwd: Path, env: Mapping[str, str], out: IO, err: IO) -> WarmProcess:
        """Fork a child running `program` with `env` in `cwd`, writing to `out` and `err`."""
        request = {"op": "start", "module": program.module, "script": program.script, "args": list(program.args),
                   "cwd": str(cwd), "env": dict(env)}  # fmt: skip
        reply = self._ask(request, [out.fileno(), err.fileno()])
        return WarmProcess(self, int(reply["pid"]), argv)

    def exit_code(self, pid: int) -> int | None:
        """`pid`'s exit status as Popen gives it (negative: killed by that signal), None while it runs."""
        code = self._ask({"op": "status", "pid": pid})["code"]
        return None if code is None else int(code)


@functools.cache
def _server_of(pid: int) -> WarmServer:
    return WarmServer()


def server() -> WarmServer:
    """This process's warm server, started on first use (a forked caller gets its own)."""
    return _server_of(os.getpid())


def popen(argv: Sequence[str], cwd: Path, env: Mapping[str, str], out: IO, err: IO) -> WarmProcess | subprocess.Popen:
    """Start `argv` warm where it can be, else cold with `subprocess.Popen`."""
    program = Program.parse(argv) if enabled() else None
    if program is not None and server().fits(env):
        return server().start(program, argv, cwd, env, out, err)
    return subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=out, stderr=err)


# The server side: runs in `python -m launch.warm <fd>` and in each child until it becomes its program.


@dataclass(frozen=True)
class _Start:
    program: Program
    cwd: str
    env: dict[str, str]
    out_fd: int
    err_fd: int


def _serve(sock: socket.socket) -> _Start:
    """Answer start and status requests until the client goes; returns only in a forked child."""
    exits: dict[int, int] = {}
    while True:
        message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        if not message:
            os._exit(0)  # the client closed its end (its process ended): nothing more to start
        request = json.loads(message)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                sock.close()
                program = Program(request["module"], request["script"], tuple(request["args"]))
                return _Start(program, request["cwd"], request["env"], fds[0], fds[1])
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"pid": pid}).encode())
        else:
            while True:  # reap every child that ended, keeping its status for the client
                try:
                    ended, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if ended == 0:
                    break
                exits[ended] = os.waitstatus_to_exitcode(status)
            sock.send(json.dumps({"code": exits.get(int(request["pid"]))}).encode())


def _become(start: _Start) -> None:
    """Turn this forked child into `start.program` (then the interpreter exits as a cold one would)."""
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (start.out_fd, 1), (start.err_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(start.cwd)
    os.environ.clear()
    os.environ.update(start.env)
    program = start.program
    if program.module is not None:
        sys.argv = [program.module, *program.args]
        sys.path[0] = start.cwd
        sys.modules.pop(program.module, None)  # run as __main__, as `python -m` would, not the preloaded copy
        runpy.run_module(program.module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.join(start.cwd, program.script or "")
        sys.argv = [program.script or "", *program.args]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def main(fd: int) -> None:
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the imports' objects are never collected: a child's collections and exit skip them
    _become(_serve(socket.socket(fileno=fd)))


if __name__ == "__main__":
    main(int(sys.argv[1]))
