"""The CPU accounting of the benchmarks (`bench.cpu`): threads are put in
the right class from their real names, a thread's CPU is read from the kernel and kept after
it ends, a process's CPU is read from /proc, and the per-checkpoint arithmetic subtracts a
baseline scaled to the job's steps. No figure of a benchmark is judged."""

from __future__ import annotations

import mmap
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.common import harmonic_of
from bench.cost import is_tmpfs
from bench.cpu import CLASSES, CpuLedger, checkpoint_cpu, process_cpu_s, thread_class


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_threads_are_classed_by_their_names() -> None:
    names = {11: "deltarec-writer-0", 12: "bench-follower"}
    assert thread_class(10, "python", names, main_tid=10) == "train"
    assert thread_class(11, "python", names, main_tid=10) == "writer"
    assert thread_class(13, "rdk:broker1", names, main_tid=10) == "kafka"
    assert thread_class(14, "rdk:main", {}, main_tid=10) == "kafka"
    assert thread_class(12, "python", names, main_tid=10) == "other"
    assert thread_class(16, "python", {16: "deltarec-host-buffers_0"}, main_tid=10) == "writer"
    assert thread_class(15, "pt_gloo", names, main_tid=10) == "other"


def test_a_ledger_counts_a_threads_cpu_in_its_class_and_keeps_it_after_the_thread_ends() -> None:
    ledger = CpuLedger().start()
    burnt, sampled = threading.Event(), threading.Event()

    def write() -> None:
        _burn(0.3)
        burnt.set()
        sampled.wait(10)  # alive until the ledger has seen all of it, however busy the cores

    writer = threading.Thread(target=write, name="deltarec-writer-0")
    writer.start()
    while not burnt.wait(0.02):  # sample while it runs
        ledger.sample()
    ledger.sample()  # its last figure, which is what counts
    sampled.set()
    writer.join()
    _burn(0.2)  # the main thread: "train"
    ledger.sample()  # the writer is gone: its last sample stays
    totals = ledger.totals()
    assert set(totals) == set(CLASSES)
    assert 0.27 <= totals["writer"] <= 0.45, totals  # 0.3 s burnt, read in kernel ticks of 10 ms
    assert 0.19 <= totals["train"] <= 0.6, totals
    assert totals["kafka"] == 0.0


def test_a_ledger_counts_page_faults_in_the_class_of_the_thread_that_touched_the_pages() -> None:
    ledger = CpuLedger().start()
    touched, sampled = threading.Event(), threading.Event()
    pages = 2000

    def write() -> None:
        mapped = mmap.mmap(-1, pages * 4096)  # anonymous, never touched: each write below maps a page
        for i in range(pages):
            mapped[i * 4096] = 1
        touched.set()
        sampled.wait(10)

    writer = threading.Thread(target=write, name="deltarec-host-buffers_0")
    writer.start()
    touched.wait(10)
    ledger.sample()
    sampled.set()
    writer.join()
    faults = ledger.faults()
    assert set(faults) == set(CLASSES)
    assert pages <= faults["writer"] < pages + 500, faults
    assert faults["train"] < pages // 2, faults  # the main thread only waited


def test_the_other_class_splits_by_thread_name_a_pools_threads_together() -> None:
    ledger = CpuLedger().start()
    burnt = [threading.Event(), threading.Event()]
    sampled = threading.Event()

    def work(i: int) -> None:
        _burn(0.15)
        burnt[i].set()
        sampled.wait(10)

    pool = [threading.Thread(target=work, args=(i,), name=f"deltarec-dense-read_{i}") for i in range(2)]
    for t in pool:
        t.start()
    while not all(e.wait(0.02) for e in burnt):
        ledger.sample()
    ledger.sample()
    sampled.set()
    for t in pool:
        t.join()
    split = ledger.by_name("other")
    assert 0.27 <= split["deltarec-dense-read"] <= 0.45, split  # both threads' 0.15 s
    assert sum(split.values()) == pytest.approx(ledger.totals()["other"])


def test_cpu_spent_before_start_is_not_counted() -> None:
    _burn(0.2)
    ledger = CpuLedger().start()
    ledger.sample()
    assert ledger.totals()["train"] < 0.1


def test_a_process_cpu_is_read_from_proc() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\nwhile time.process_time()-t<0.5: pass\n"
            "import sys; sys.stdout.write('done\\n'); sys.stdout.flush(); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        cpu = process_cpu_s(child.pid)
        assert cpu is not None and 0.45 <= cpu <= 3.0, cpu  # its interpreter's start-up counts too
    finally:
        child.kill()
        child.wait()
    assert process_cpu_s(child.pid) is None  # reaped: gone


def _rank(steps: int, train: float, writer: float = 0.0, kafka: float = 0.0, other: float = 0.0, stall: float = 0.0) -> dict:
    return {"steps": steps, "threads": {"train": train, "writer": writer, "kafka": kafka, "other": other}, "stall_cpu_s": stall}


def test_checkpoint_cpu_subtracts_the_baseline_scaled_to_the_jobs_steps() -> None:
    # baseline: two jobs of 100 steps a rank (train 10 s, other 2 s a rank and job); the job:
    # one run of 100 steps a rank, 4 checkpoints
    base = [_rank(100, 10.0, other=2.0) for _ in range(4)]
    job = [_rank(100, 11.0, writer=0.8, kafka=0.2, other=2.4, stall=0.4) for _ in range(2)]
    got = checkpoint_cpu(job, base, checkpoints=4, broker_s=1.2)
    assert got["cpu_train_s_per_ckpt"] == pytest.approx(2 * 1.0 / 4)  # 22 - 20 (base scaled by 200/400)
    assert got["cpu_stall_s_per_ckpt"] == pytest.approx(0.8 / 4)
    assert got["cpu_writer_s_per_ckpt"] == pytest.approx(1.6 / 4)
    assert got["cpu_kafka_s_per_ckpt"] == pytest.approx(0.4 / 4)
    assert got["cpu_other_s_per_ckpt"] == pytest.approx(0.8 / 4)
    assert got["cpu_trainer_s_per_ckpt"] == pytest.approx((2.0 + 1.6 + 0.4 + 0.8) / 4)
    assert got["cpu_broker_s_per_ckpt"] == pytest.approx(0.3)
    assert got["cpu_trainer_overhead"] == pytest.approx(4.8 / 24.0)
    # direct: stalls 0.8 + writer 1.6 + librdkafka 0.4, nothing subtracted
    assert got["cpu_direct_s_per_ckpt"] == pytest.approx(2.8 / 4)
    assert got["cpu_direct_overhead"] == pytest.approx(2.8 / 24.0)
    assert checkpoint_cpu(job, base, checkpoints=4)["cpu_broker_s_per_ckpt"] is None  # no broker: the tmpfs sink
    assert checkpoint_cpu(job, base, checkpoints=0) == {}


def test_is_tmpfs_reads_the_mount_table(tmp_path: Path) -> None:
    mounts = Path("/proc/mounts").read_text().split()
    if "/dev/shm" in mounts and mounts[mounts.index("/dev/shm") + 1] == "tmpfs":
        assert is_tmpfs(Path("/dev/shm"))
    assert not is_tmpfs(Path("/proc"))


def test_the_cost_suite_reverses_the_sinks_in_odd_rounds() -> None:
    from bench.cost import round_order

    sinks = ["kafka", "tmpfs"]
    assert [round_order(sinks, n) for n in range(3)] == [["kafka", "tmpfs"], ["tmpfs", "kafka"], ["kafka", "tmpfs"]]
    assert sinks == ["kafka", "tmpfs"]  # not reversed in place


def test_a_counted_job_carries_how_much_the_kernels_page_faults_grew_while_it_ran() -> None:
    from bench.cost import counted, jobs_table, vmstat

    assert {"pgfault", "pgmajfault"} <= set(vmstat())

    def job() -> dict:
        pages = b"\1" * (64 << 20)  # 64 MiB of fresh memory, every page written: a fault each
        assert pages[-1] == 1
        return {"sink": "none", "round": 0, "samples_per_s": 123.4, "pace_excess": 0.0123}

    out = counted(job)
    assert out["vmstat"]["pgfault"] >= 64 * 256 // 2, out["vmstat"]  # half the 4 KiB pages at least (huge pages)
    assert all(v >= 0 for v in out["vmstat"].values()), out["vmstat"]
    lines = jobs_table([out]).splitlines()
    assert lines[0].startswith("| job (in run order) | round | samples/s | pace excess | pgfault |")
    assert lines[2].startswith("| none | 0 | 123 | 1.2% | ")


def test_a_jobs_pace_excess_is_its_time_beyond_its_own_median_pace() -> None:
    from bench.cost import pace_excess

    assert pace_excess([100.0] * 9) == pytest.approx(0.0)
    assert pace_excess([50.0] * 9) == pytest.approx(0.0)  # a slower machine alike in every window: none
    # one window of ten at half the pace takes 2 units of the job's 11: 1/11 of the time beyond its pace
    assert pace_excess([100.0] * 9 + [50.0]) == pytest.approx(1 / 11)
    assert pace_excess([]) is None


def test_the_overhead_within_jobs_is_a_sinks_pace_excess_less_the_baselines() -> None:
    from bench.cost import summarize, table

    def job(sink: str, rates: list[float]) -> dict:
        from bench.cost import pace_excess

        return {
            "sink": sink,
            "round": 0,
            "samples_per_s": harmonic_of(rates),
            "window_rates": rates,
            "pace_excess": pace_excess(rates),
            "cpu": [],
            "checkpoints": [],
            "broker_cpu_s": None,
        }

    # the baselines run at different paces (a drifting machine), one slow window each; the sink's
    # job is slower than either baseline and has three slow windows
    jobs = [job("none", [100.0] * 9 + [50.0]), job("kafka", [80.0] * 7 + [40.0] * 3), job("none", [70.0] * 9 + [35.0])]
    got = summarize(jobs)
    assert got["none"]["pace_excess"] == pytest.approx(1 / 11)
    assert got["kafka"]["pace_excess"] == pytest.approx(1 - 10 / 13)
    assert got["kafka"]["throughput_overhead_within"] == pytest.approx(1 - 10 / 13 - 1 / 11)
    assert got["kafka"]["throughput_overhead"] > got["kafka"]["throughput_overhead_within"]  # drift counted too
    row = [line for line in table(got).splitlines() if line.startswith("| kafka |")][0]
    assert f"| {100 * (1 - 10 / 13 - 1 / 11):.1f}% |" in row
