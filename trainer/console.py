"""What a user sees on the terminal: deltarec's lines, and library output only when it matters.

The one place for logging setup and for the known-noise filters. A training rank calls
`setup_rank` first thing; `deltarec-launch` calls `quiet_launcher`; `deltarec-follow` and
`deltarec-ckpt` add `EXPORT_NOISE`. Each filter in `TRAINER_NOISE`, `CUDA_NOISE` (a GPU rank's),
`LAUNCHER_NOISE` and `EXPORT_NOISE` names exactly one library message (by category, message and module for a Python
warning; by logger and message for a log record) and says in one line why a user can do nothing
about it. Anything not listed still shows. `--verbose` installs none of them and shows
every rank's own log lines, so the libraries' full output comes back.

Rank 0 prints deltarec's lines: the process group, the plan, progress (a bar on a terminal,
periodic lines otherwise), one line per checkpoint, the summary. Checkpoints that come faster
than one per `CHECKPOINT_WINDOW_S` are folded into one line (`CheckpointDigest`), so frequent
checkpoints do not flood the console. Other ranks print only warnings and errors. A rank
whose peer died prints one line instead of gloo's traceback (`peer_lost_line`), and the
launcher one line for the rank that died (launch/torchrun.py).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from ckpt.events import CheckpointOutcome, CheckpointSkipped

EXIT_PEER_LOST = 3
"""The exit status of a rank that stopped because another rank of the job died; the launcher
tells such a rank apart from the one that failed first."""

EXIT_STALLED = 4
"""The exit status of a rank whose collective timed out: another rank stopped answering (hung,
SIGSTOPped, stuck in I/O) but did not die; like EXIT_PEER_LOST, not the job's root cause."""

CHECKPOINT_WINDOW_S = 2.0
"""Checkpoints that come closer together than this are frequent: folded into one line..."""
CHECKPOINT_HOLD_S = 10.0
"""...printed at least this often (or before deltarec's next other line)."""

LIBRDKAFKA_LOGGER = "deltarec.librdkafka"  # where ckpt/stream/kafka/admin.py sends librdkafka's log
REPEAT_WINDOW_S = 60.0

AGENT_GRACE_S = 30.0
"""How long a rank that lost its peers waits for torchrun's agent to stop it (`wait_for_agent`)."""

DELTAREC_LOGGERS = ("deltarec", "trainer", "sharding", "ckpt", "launch")


@dataclass(frozen=True)
class WarningNoise:
    """A Python warning to ignore: `message` is matched at the start of the text, `module`
    against the module that the warning points at (as `warnings.filterwarnings` does)."""

    category: type[Warning]
    message: str
    module: str
    reason: str


@dataclass(frozen=True)
class LogNoise:
    """A log record to drop: emitted on `logger` (exactly) with a message matching `message`
    at its start; `level` drops every record of the logger below that level instead."""

    logger: str
    message: str
    reason: str
    level: int = logging.NOTSET


TRAINER_NOISE: tuple[WarningNoise | LogNoise, ...] = (
    WarningNoise(
        FutureWarning,
        r"HeuristicalStorageReservation is known to cause issues",
        r"torchrec\.distributed\.planner\.",
        "torchrec's planner default; it concerns the planner's dense-memory estimate, and deltarec prints its own bytes per rank",
    ),
    WarningNoise(
        FutureWarning,
        r"`broadcast_buffers` is deprecated",
        r"torchrec\.distributed\.",
        "torchrec itself passes the deprecated DistributedDataParallel argument; no deltarec setting reaches it",
    ),
    WarningNoise(
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed\.c10d_logger",
        "torchrec's pooled-embedding collectives call the deprecated names; deltarec calls neither",
    ),
    WarningNoise(
        UserWarning,
        r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
        r"torch\.autograd\.graph",
        "fbgemm's data_parallel lookup computes its own backward, registered off the Autograd key; its gradients "
        "are right (tests/unit/test_console.py checks them)",
    ),
    LogNoise(
        "torch.fx._symbolic_trace",
        r"is_fx_tracing will return true for both",
        "torchrec's KTRegroupAsDict asks is_fx_tracing() in its first forward; the note is for code that tells fx "
        "tracing from export apart, and deltarec traces nothing",
    ),
    LogNoise(
        "root",
        r"Sharding spec not found for .*\.",
        "torchrec's planner checks every table's shard ranks; data_parallel tables are replicated and have no shards to check",
    ),
    LogNoise(
        "torchrec.distributed.utils",
        r"Sharding Type is data_parallel, caching params will be ignored",
        "torchrec says it for every data_parallel table; deltarec sets no caching parameters",
    ),
    LogNoise(
        "torchrec.distributed.comm",
        r"TORCHREC_RESOLVED_POD_SIZE not set",
        "a pod is one node here: torchrec's fallback to LOCAL_WORLD_SIZE is the right size",
    ),
    LogNoise(
        "torchrec.distributed.comm",
        r"\[Connection\] (intra|cross)_group:",
        "torchrec lists the node-local process groups it builds, at warning level",
    ),
    LogNoise(
        "torchrec.distributed.planner",
        "",
        "the planner's long estimates; deltarec prints the plan table instead",
        level=logging.ERROR,
    ),
)
"""The noise of a training rank (torchrec, fbgemm, torch); each entry says why it is noise."""

CUDA_NOISE: tuple[WarningNoise | LogNoise, ...] = (
    WarningNoise(
        UserWarning,
        r"TBE B200 optimization: device_major=",
        r"torch\.autograd\.graph",
        "fbgemm-gpu's CUDA backward says, once per kernel, whether its Blackwell-only path is on; on any GPU it "
        "is a note about fbgemm's own dispatch (seen on an H100)",
    ),
)
"""The noise only a rank on a GPU makes (so a CPU job, which the console tests run, cannot show it)."""

EXPORT_NOISE: tuple[WarningNoise, ...] = (
    WarningNoise(
        UserWarning,
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to save "
        r"in a single process",
        r"torch\.distributed\.checkpoint\.",
        "dcp.save in a process without a process group (the follower's serving snapshots, deltarec-ckpt export): "
        "a single process writing the whole model is the intent",
    ),
)
"""The noise of a single process writing a DCP export (`deltarec-follow`, `deltarec-ckpt`)."""

LAUNCHER_NOISE: tuple[LogNoise, ...] = (
    LogNoise(
        "torch.distributed.run",
        r"\n\*+\nSetting OMP_NUM_THREADS environment variable",
        "torchrun's banner; the trainer sets each rank's threads itself (train.threads_per_rank)",
    ),
    LogNoise(
        "torch.distributed.elastic.multiprocessing.api",
        r"Sending process \d+ closing signal SIG[A-Z]+$",
        "the agent stopping the ranks after one failed or a signal came; the launcher's line says which",
    ),
    LogNoise(
        "torch.distributed.elastic.agent.server.api",
        r"Received [\w.]+ death signal, shutting down workers",
        "the launcher's 'stopped by' line says it",
    ),
)
"""The noise of torchrun's agent in `deltarec-launch`; its failure lines become deltarec's own."""


class NoiseFilter(logging.Filter):
    """Drops the records of one logger whose message matches any of `patterns` (at the start)."""

    def __init__(self, patterns: Iterable[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def install_noise_filters(noise: Iterable[WarningNoise | LogNoise]) -> None:
    """Ignore each listed warning and drop each listed log record, where it is emitted."""
    by_logger: dict[str, list[str]] = {}
    for entry in noise:
        if isinstance(entry, WarningNoise):
            warnings.filterwarnings("ignore", message=entry.message, category=entry.category, module=entry.module)
        elif entry.level:
            logging.getLogger(entry.logger).setLevel(entry.level)
        else:
            by_logger.setdefault(entry.logger, []).append(entry.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        logger.filters = [f for f in logger.filters if not isinstance(f, NoiseFilter)]
        logger.addFilter(NoiseFilter(patterns))


# --- formatting ------------------------------------------------------------------------------


class ConsoleFormatter(logging.Formatter):
    """deltarec's own progress as `HH:MM:SS message`; warnings and errors, and everything in
    verbose mode, also name the rank, level and logger."""

    def __init__(self, rank: int, verbose: bool) -> None:
        super().__init__(datefmt="%H:%M:%S")
        self.rank = rank
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        when = self.formatTime(record, self.datefmt)
        if self.verbose or record.levelno >= logging.WARNING or not _is_deltarec(record.name):
            return f"{when} [rank{self.rank}] {record.levelname} {record.name}: {message}"
        return f"{when} {message}"


def _is_deltarec(name: str) -> bool:
    return name.split(".", 1)[0] in DELTAREC_LOGGERS


# --- checkpoint lines --------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointNote:
    """What the digest keeps of one checkpoint's event (ckpt/events.py), which the checkpointer
    attaches to its log line (`extra={"ckpt": event}`)."""

    step: int
    committed: bool = False
    skipped: bool = False
    coalesced: bool = False  # skipped, its rows left to the next checkpoint
    checkpoint_id: int = 0
    full: bool = False
    bytes: int = 0
    stall_ms: float = 0.0

    @classmethod
    def of(cls, record: logging.LogRecord) -> CheckpointNote | None:
        """The note of a log line that carries a checkpoint event; None for any other line."""
        event = getattr(record, "ckpt", None)
        if isinstance(event, CheckpointOutcome):
            return cls(
                step=event.step,
                committed=event.ckpt_committed,
                checkpoint_id=event.ckpt_id,
                full=event.ckpt_full,
                bytes=event.ckpt_bytes,
                stall_ms=event.ckpt_stall_ms,
            )
        if isinstance(event, CheckpointSkipped):
            return cls(step=event.step, skipped=True, coalesced=event.ckpt_coalesced)
        return None


class CheckpointDigest:
    """One line per checkpoint while they come at most one per `window_s`. Faster than that,
    they are held and folded into one line, printed before deltarec's next other line or
    once the oldest held is `hold_s` old. A failed checkpoint is never held."""

    def __init__(
        self,
        window_s: float = CHECKPOINT_WINDOW_S,
        hold_s: float = CHECKPOINT_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.hold_s = hold_s
        self.clock = clock
        self.held: list[tuple[CheckpointNote, str, str]] = []  # note, its own line, its time stamp
        self.held_since = 0.0
        self.last_seen = float("-inf")

    def offer(self, note: CheckpointNote, line: str, stamp: str) -> list[str]:
        """The lines to print now that `note` arrived; `line` is its own line, `stamp` the
        time a folded line starts with."""
        now = self.clock()
        frequent, self.last_seen = now - self.last_seen < self.window_s, now
        if not frequent or (not note.committed and not note.skipped):
            return [*self.flush(), line]
        if not self.held:
            self.held_since = now
        self.held.append((note, line, stamp))
        return self.flush() if now - self.held_since >= self.hold_s else []

    def flush(self) -> list[str]:
        """The held checkpoints as one line (none held: no line)."""
        held, self.held = self.held, []
        if len(held) <= 1:
            return [line for _, line, _ in held]
        return [f"{held[-1][2]} {summarize_checkpoints([note for note, _, _ in held])}"]


def summarize_checkpoints(notes: list[CheckpointNote]) -> str:
    """One line for several checkpoints: ids, steps, kinds, bytes, worst stall, skips."""
    done = [n for n in notes if n.committed]
    skipped = [n for n in notes if n.skipped and not n.coalesced]
    coalesced = [n for n in notes if n.coalesced]
    parts = []
    if done:
        full = sum(n.full for n in done)
        parts.append(
            f"checkpoints {done[0].checkpoint_id}-{done[-1].checkpoint_id} committed "
            f"(steps {done[0].step}-{done[-1].step}; {full} full, {len(done) - full} delta): "
            f"{sum(n.bytes for n in done) / 1e6:.2f} MB, stall max {max(n.stall_ms for n in done):.1f} ms"
        )
    if skipped:
        steps = f"step {skipped[0].step}" if len(skipped) == 1 else f"steps {skipped[0].step}-{skipped[-1].step}"
        parts.append(f"{len(skipped)} checkpoint(s) skipped at {steps}: the writers are behind (ckpt.write.max_pending_bytes)")
    if coalesced:
        steps = f"step {coalesced[0].step}" if len(coalesced) == 1 else f"steps {coalesced[0].step}-{coalesced[-1].step}"
        parts.append(
            f"{len(coalesced)} checkpoint(s) due at {steps} coalesced into the next: "
            "the writers are behind (ckpt.write.max_pending_checkpoints)"
        )
    return "; ".join(parts)


# --- the handler -------------------------------------------------------------------------------


class ConsoleHandler(logging.Handler):
    """Writes records to stderr without breaking a progress bar (through `tqdm.write`), and
    folds frequent checkpoint lines (`CheckpointDigest`) unless `digest` is None. Unless
    verbose, it drops records of failures a peer's death caused (`reports_peer_lost`): that
    death is one line already, the rank's own and the launcher's."""

    def __init__(self, formatter: ConsoleFormatter, digest: CheckpointDigest | None) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.console_formatter = formatter
        self.digest = digest

    def emit(self, record: logging.LogRecord) -> None:
        if not self.console_formatter.verbose and reports_peer_lost(record):
            return  # the rank's own line (and the launcher's) report the death, without a traceback
        try:
            line = self.format(record)
            note = CheckpointNote.of(record) if self.digest is not None else None
            if note is not None and self.digest is not None:
                self.write(self.digest.offer(note, line, self.console_formatter.formatTime(record, "%H:%M:%S")))
            else:
                self.write([*self.held_lines(), line])
        except Exception:  # noqa: BLE001 - logging.Handler's contract: a handler never raises, handleError reports
            self.handleError(record)

    def held_lines(self) -> list[str]:
        """The checkpoint line still held back, if any (and no longer held)."""
        return self.digest.flush() if self.digest is not None else []

    def write(self, lines: list[str]) -> None:
        stream = sys.stderr  # looked up at each write: pytest swaps sys.stderr
        for line in lines:
            tqdm.write(line, file=stream)
        stream.flush()

    def close(self) -> None:
        try:
            self.write(self.held_lines())
        finally:
            super().close()


_handler: ConsoleHandler | None = None


def setup_rank(
    rank: int, verbose: bool = False, noise: Iterable[WarningNoise | LogNoise] = (*TRAINER_NOISE, *CUDA_NOISE)
) -> None:
    """Configure this training rank's console: deltarec's INFO lines on rank 0 only, warnings
    and errors everywhere, the known `noise` filtered (none of that with `verbose`)."""
    global _handler
    root = logging.getLogger()
    for h in list(root.handlers):  # an import may already have configured the root logger
        root.removeHandler(h)
    _handler = ConsoleHandler(ConsoleFormatter(rank, verbose), None if verbose else CheckpointDigest())
    root.addHandler(_handler)
    root.setLevel(logging.WARNING)
    for name in DELTAREC_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if rank == 0 or verbose else logging.WARNING)
    if not verbose:
        install_noise_filters(noise)
        logging.captureWarnings(True)  # unfiltered warnings go through the handler too (bar-safe)
        # librdkafka repeats a connection failure at every reconnect (every second or faster)
        # while a broker is down: the first shows, then one line per minute with the count.
        logging.getLogger(LIBRDKAFKA_LOGGER).addFilter(RepeatFilter(REPEAT_WINDOW_S))


class RepeatFilter(logging.Filter):
    """Lets a message through once per `window_s`; the next one after the window says how
    many like it were held back. Messages count as alike when they differ only in numbers."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self.seen: dict[str, tuple[float, int]] = {}  # shape -> (when last shown, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        shape = re.sub(r"\d+", "#", record.getMessage())
        now = self.clock()
        shown, held = self.seen.get(shape, (None, 0))
        if shown is not None and now - shown < self.window_s:
            self.seen[shape] = (shown, held + 1)
            return False
        self.seen[shape] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} more like it in the last {self.window_s:g} s)"
            record.args = None
        return True


def say(line: str, err: bool = False) -> None:
    """Print one of deltarec's result lines on stdout (`err`: stderr) after any checkpoint
    lines still held, without breaking a progress bar."""
    if _handler is not None:
        _handler.write(_handler.held_lines())
    tqdm.write(line, file=sys.stderr if err else sys.stdout)
    (sys.stderr if err else sys.stdout).flush()


# --- a rank that lost its peers ------------------------------------------------------------------

PEER_LOST = re.compile(r"(Connection closed by peer|Connection reset by peer|Broken pipe)( \[[^\]]*\]:\d+)?")
"""What gloo says (in a `RuntimeError`, with its source path) when the other end of a
rank-to-rank connection is gone: the process at that end died."""


def says_peer_lost(text: str) -> bool:
    """Whether `text` (an error message, a formatted traceback) is gloo's report of a peer gone.
    Other libraries' "connection reset" (a broker's, say) do not count."""
    return "gloo" in text and PEER_LOST.search(text) is not None


def is_peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank's process is gone."""
    return isinstance(exc, RuntimeError) and says_peer_lost(str(exc))


STALLED = re.compile(r"Timed out waiting (\d+)ms for (send|recv) operation")
"""What gloo says when a collective's peer stopped answering within the process group's timeout."""
PAIR_TIMED_OUT = "Application timeout caused pair closure"
"""What gloo says instead to an operation on a connection whose earlier operation timed out
(which of the two a rank meets first depends on timing)."""
_BACKWARD_CODE = "/torch/autograd/"
"""A collective waited inside the autograd engine (DDP's gradient all-reduce, run by its C++ reducer,
or a backward all-to-all) leaves no Python frame of its own below this one."""
_COLLECTIVE_CODE = ("/torchrec/", "/torch/distributed/", "/torch/nn/parallel/", _BACKWARD_CODE)


def is_stalled_collective(exc: BaseException) -> bool:
    """Whether `exc` is a collective that timed out waiting for another rank (alive, silent)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo" in text and STALLED.search(text) is not None or PAIR_TIMED_OUT in text)


def stalled_collective(exc: BaseException) -> str:
    """Where `exc` stalled: the innermost frame of torchrec's or torch.distributed's code (the
    collective), and the innermost of deltarec's own (what deltarec was doing), from its traceback."""
    frames = [(frame.f_code, line) for frame, line in traceback.walk_tb(exc.__traceback__)]

    def name(found: tuple | None) -> str | None:
        if found is None:
            return None
        code, line = found
        parts = code.co_filename.replace(os.sep, "/").split("/")
        where = f"{code.co_qualname} ({'/'.join(parts[-2:])}:{line})"
        if _BACKWARD_CODE in code.co_filename.replace(os.sep, "/"):
            return f"the backward pass's gradient all-reduce or all-to-all, {where}"
        return where

    library = name(next((f for f in reversed(frames) if any(p in f[0].co_filename for p in _COLLECTIVE_CODE)), None))
    ours = name(
        next(
            (f for f in reversed(frames) if "site-packages" not in f[0].co_filename and "/lib/python" not in f[0].co_filename),
            None,
        )
    )
    where = " in ".join(n for n in (library, ours) if n)
    return where or "an unknown collective"


def stalled_line(rank: int, exc: BaseException, timeout_s: float | None = None) -> str:
    """The one line a rank prints when a collective timed out: how long it waited (gloo's own
    figure, else the configured `timeout_s`: its pair-closure message has none), where."""
    m = STALLED.search(str(exc))
    waited = f"{int(m[1]) / 1000:g} s" if m else f"{timeout_s:g} s" if timeout_s else "the timeout"
    return (
        f"deltarec-train: rank {rank} stopped: a collective waited {waited} (sharding.timeout_s) for a rank that "
        f"does not answer: {stalled_collective(exc)}"
    )


def reports_peer_lost(record: logging.LogRecord) -> bool:
    """Whether `record` reports a failure caused by a peer's death (a checkpoint writer's
    collective failing, the checkpoint it failed), by the exception attached or its text."""
    if record.exc_info and record.exc_info[1] is not None:
        return is_peer_lost(record.exc_info[1])
    return says_peer_lost(record.getMessage())


def peer_lost_line(rank: int, exc: BaseException) -> str:
    """The one line a rank prints instead of the gloo traceback: the connection that closed."""
    found = PEER_LOST.search(str(exc))
    return f"deltarec-train: rank {rank} stopped: another rank of the job is gone ({found[0] if found else exc})"


def wait_for_agent(grace_s: float = AGENT_GRACE_S) -> None:
    """Under torchrun, give its agent `grace_s` to stop this rank (SIGTERM ends the process here).

    A rank that lost its peers has nothing left to do, but exiting on its own would race the
    rank that died: when the agent finds both gone, torchrun names the first by timestamp, and
    ties go to the lower rank, usually the one that only lost its peers. Stopped by the agent,
    this rank is recorded after the one that died. Without torchrun it returns at once."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        time.sleep(grace_s)


def exit_description(exitcode: int) -> str:
    """`-9` -> `SIGKILL`, `3` -> `exit code 3`: how a rank's process ended."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def quiet_launcher() -> None:
    """Drop torchrun's known noise in this (the launcher's) process."""
    install_noise_filters(LAUNCHER_NOISE)


def clear_line(stream: Any) -> str:
    """On a terminal, what erases a half-drawn progress bar of a rank that was stopped."""
    return "\r\x1b[K" if getattr(stream, "isatty", lambda: False)() else ""
