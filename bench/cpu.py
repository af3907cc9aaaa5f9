"""CPU seconds by thread and by process, for the checkpoint cost accounting of the suites:
which of a rank's threads spent the CPU a checkpoint costs, and how much
the co-located broker spent beside them.

A rank's threads fall in four classes:

- ``train``: the main thread, which runs the training loop (and the checkpoint stall);
- ``writer``: deltarec's writer thread (``deltarec-writer-<rank>``: encode, produce, commit),
  its copier thread (``deltarec-snapshot``: a checkpoint's copy beside the next step) and the
  host buffers' helper (``deltarec-host-buffers``: the next snapshot's memory made and faulted
  in ahead), the threads only checkpointing runs;
- ``kafka``: librdkafka's own threads (named ``rdk:main``, ``rdk:broker<n>``, ...), which
  serialize, compress and send what the writer produced;
- ``other``: everything else (gloo's and torch's worker threads, the dense-file thread).

Per thread the kernel's ``/proc/self/task/<tid>/schedstat`` gives nanoseconds on a CPU
(``stat``'s 10 ms ticks where it is missing). A thread's figure is kept at its last sample,
so a thread that ends between samples counts up to the sample before; callers sample while
the threads they measure are alive. A process's figure (the broker) comes from
``/proc/<pid>/stat``: utime + stime of all its threads, ended ones included, in clock ticks.
Hand-rolled because psutil is not a dependency and reads the same files.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

CLASSES = ("train", "writer", "kafka", "other")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_class(tid: int, comm: str, names: dict[int, str], main_tid: int) -> str:
    """The class of thread `tid` (kernel name `comm`; `names`: Python threads' names by native id)."""
    if tid == main_tid:
        return "train"
    if names.get(tid, "").startswith(("deltarec-writer", "deltarec-snapshot", "deltarec-host-buffers")):
        return "writer"
    if comm.startswith("rdk:"):
        return "kafka"
    return "other"


def _thread_cpu_s(task: Path) -> tuple[str, float, int] | None:
    """(kernel name, CPU seconds, minor page faults) of one task directory, None if it ended
    meanwhile."""
    try:
        stat = (task / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    minflt = int(fields[7])  # field 10 of stat
    try:
        return comm, int((task / "schedstat").read_text().split()[0]) / 1e9, minflt
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return comm, (int(fields[11]) + int(fields[12])) / _TICK, minflt  # utime, stime (fields 14, 15 of stat)


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds process `pid` has spent, all its threads (ended ones too); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class ThreadCpu:
    """One thread's class, its CPU seconds and minor page faults at the last sample (`name`: its
    Python name, or the kernel's for a thread Python did not start)."""

    comm: str
    klass: str
    cpu_s: float
    name: str
    minflt: int = 0


@dataclass
class CpuLedger:
    """This process's threads' CPU from `start()` on, by class. `sample()` while the threads
    to account are alive (each keeps its newest figure); `totals()` sums per class what each
    thread spent since `start()` (a thread started later counts from zero)."""

    started: dict[int, ThreadCpu] = field(default_factory=dict)  # each thread's figures at `start()`
    threads: dict[int, ThreadCpu] = field(default_factory=dict)

    def start(self) -> CpuLedger:
        self.started = _read_threads()
        self.threads = {}
        self.sample()
        return self

    def sample(self) -> None:
        for tid, t in _read_threads().items():
            self.threads[tid] = t

    def totals(self) -> dict[str, float]:
        out = dict.fromkeys(CLASSES, 0.0)
        for tid, t in self.threads.items():
            out[t.klass] += self._cpu_since_start(tid, t)
        return out

    def _cpu_since_start(self, tid: int, t: ThreadCpu) -> float:
        before = self.started.get(tid)
        return max(0.0, t.cpu_s - (before.cpu_s if before else 0.0))

    def faults(self) -> dict[str, int]:
        """Minor page faults per class since `start()`: a page mapped for the first time costs
        CPU where it is touched (which thread's, these say)."""
        out = dict.fromkeys(CLASSES, 0)
        for tid, t in self.threads.items():
            before = self.started.get(tid)
            out[t.klass] += max(0, t.minflt - (before.minflt if before else 0))
        return out

    def by_name(self, klass: str) -> dict[str, float]:
        """`totals()[klass]` split by thread name, a pool's threads together (trailing
        numbers dropped: ``deltarec-dense-read_0`` and ``_1`` are ``deltarec-dense-read``)."""
        out: dict[str, float] = {}
        for tid, t in self.threads.items():
            if t.klass == klass:
                name = re.sub(r"[-_:]?\d+$", "", t.name) or t.name
                out[name] = out.get(name, 0.0) + self._cpu_since_start(tid, t)
        return out


def _read_threads() -> dict[int, ThreadCpu]:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main_tid = threading.main_thread().native_id or os.getpid()
    out = {}
    for task in Path("/proc/self/task").iterdir():
        got = _thread_cpu_s(task)
        if got is not None:
            tid = int(task.name)
            out[tid] = ThreadCpu(got[0], thread_class(tid, got[0], names, main_tid), got[1], names.get(tid, got[0]), got[2])
    return out


def checkpoint_cpu(job: list[dict], base: list[dict], checkpoints: int, broker_s: float | None = None) -> dict[str, float | None]:
    """CPU seconds per checkpoint a checkpointing job spent beyond the same job without
    checkpoints, summed over ranks (`job`, `base`: every rank's `bench.ckpt_rank.RankCpu` as a
    dict). The baseline is scaled to the job's steps. Keys (seconds per checkpoint):
    ``cpu_train`` the training thread's extra CPU (the stall, the tracker's hook, ...),
    ``cpu_stall`` its part inside the stalls, ``cpu_writer`` the writer class, ``cpu_kafka``
    librdkafka's threads, ``cpu_other`` the other threads' extra CPU, ``cpu_trainer`` all of
    the trainer's process, ``cpu_broker`` the broker process (`broker_s`: its CPU during the
    job); and ``cpu_trainer_overhead``, the trainer's extra CPU as a fraction of the baseline's.

    ``cpu_direct`` is the CPU spent where only checkpointing runs: the training thread inside
    stalls, the ``writer`` class (writer, copier, host buffers) and librdkafka's threads (none
    of which the baseline has), with
    ``cpu_direct_overhead`` its fraction of the baseline's CPU. Unlike the differences above
    it subtracts nothing, so it does not carry the run-to-run noise of two whole jobs' CPU (a
    few percent on a shared VM); it leaves out the tracker's hook on every step (suite
    ``tracker``) and any slowdown of training by cache or memory-bandwidth contention."""
    if not checkpoints or not job or not base:
        return {}
    scale = sum(r["steps"] for r in job) / max(1, sum(r["steps"] for r in base))

    def extra(klass: str) -> float:
        return sum(r["threads"][klass] for r in job) - scale * sum(r["threads"][klass] for r in base)

    base_total = scale * sum(sum(r["threads"].values()) for r in base)
    parts = {"cpu_train": extra("train"), "cpu_writer": extra("writer"), "cpu_kafka": extra("kafka"), "cpu_other": extra("other")}
    trainer = sum(parts.values())
    out: dict[str, float | None] = {f"{k}_s_per_ckpt": v / checkpoints for k, v in parts.items()}
    out["cpu_stall_s_per_ckpt"] = sum(r["stall_cpu_s"] for r in job) / checkpoints
    out["cpu_trainer_s_per_ckpt"] = trainer / checkpoints
    out["cpu_broker_s_per_ckpt"] = broker_s / checkpoints if broker_s is not None else None
    out["cpu_trainer_overhead"] = trainer / base_total if base_total else None
    direct = sum(r["stall_cpu_s"] + r["threads"]["writer"] + r["threads"]["kafka"] for r in job)
    out["cpu_direct_s_per_ckpt"] = direct / checkpoints
    out["cpu_direct_overhead"] = direct / base_total if base_total else None
    return out
