"""trainer/data/loader.py: batches read ahead by DataLoader workers, in the reader's order,
each with the position after it; the loop's position counts trained batches only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from launch.ranks import REPO
from tests.unit.test_criteo_reader import assert_batches_equal, marked, reader, write
from trainer.data.loader import positioned_batches
from trainer.data.reader import DataError
from trainer.data.synthetic import SyntheticClickStream

CPU = torch.device("cpu")


def stream(rank: int = 1, world_size: int = 2) -> SyntheticClickStream:
    return SyntheticClickStream(
        feature_names=["a", "b"], num_embeddings=[100, 50], num_dense=3, batch_size=8, rank=rank, world_size=world_size, seed=7
    )


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_batches_come_in_the_readers_order_with_the_position_after_each(workers: int) -> None:
    """Rank 1 of 2 from global batch 4: the loader yields global batches 5, 7, 9, ... whatever
    the number of workers; `trained` moves one batch per `trained_one`, not per batch read."""
    r = stream()
    r.load_state_dict({"next_global_batch": 4})
    batches = positioned_batches(r, workers, prefetch=2, device=CPU)
    try:
        got = [next(batches) for _ in range(7)]
        assert batches.in_flight == 7
        assert batches.trained == {"next_global_batch": 4}
        for k, b in enumerate(got):
            assert_batches_equal(b, r.batch_at(4 + 2 * k + 1))
        batches.trained_one()
        batches.trained_one()
        assert batches.trained == {"next_global_batch": 8}
        assert batches.in_flight == 5
    finally:
        batches.close()


def test_several_workers_need_a_reader_that_skips(tmp_path: Path) -> None:
    path = write(tmp_path / "day.tsv", [marked(i) for i in range(20)])
    batches = positioned_batches(reader([path]), 2, prefetch=2, device=CPU)
    with pytest.raises(DataError, match="cannot skip batches"):
        next(batches)
    batches.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_malformed_line_in_a_worker_is_one_line_naming_it(tmp_path: Path, workers: int) -> None:
    """The worker's error comes back as the reader's own one-line message (file:line), not the
    DataLoader's wrapped traceback; batches before it arrive first."""
    lines = [marked(i) for i in range(6)] + ["1\tnot-a-number"] + [marked(i) for i in range(6, 12)]
    path = write(tmp_path / "day.tsv", lines)
    batches = positioned_batches(reader([path]), workers, prefetch=2, device=CPU)
    try:
        next(batches)  # lines 1-4
        with pytest.raises(DataError) as caught:
            next(batches)
        message = str(caught.value)
        assert f"{path}:7" in message and "\n" not in message
    finally:
        batches.close()


def test_criteo_positions_resume_exactly(tmp_path: Path) -> None:
    """A Criteo reader behind a worker: the position after the 2nd trained batch, loaded into a
    fresh reader, yields the 3rd batch, though the worker had read further."""
    path = write(tmp_path / "day.tsv", [marked(i) for i in range(40)])
    batches = positioned_batches(reader([path]), 1, prefetch=2, device=CPU)
    try:
        got = [next(batches) for _ in range(4)]
        batches.trained_one()
        batches.trained_one()
        fresh = reader([path])
        fresh.load_state_dict(batches.trained)
        assert_batches_equal(fresh.next_batch(), got[2])
    finally:
        batches.close()


# A rank whose two workers both raise (a reader that cannot skip, split among them): the error
# comes back through the DataLoader, whose iterator its traceback keeps alive.
FAILS = """
import sys
import torch
from pathlib import Path
from tests.unit.test_criteo_reader import marked, reader, write
from trainer.data.loader import positioned_batches
from trainer.data.reader import DataError

path = write(Path(sys.argv[1]) / "day.tsv", [marked(i) for i in range(20)])
batches = positioned_batches(reader([path]), 2, prefetch=2, device=torch.device("cpu"))
try:
    next(batches)
except DataError as exc:
    error = exc  # kept, as a caller reporting it may
    print("error:", exc, flush=True)
finally:
    batches.close()
"""


def test_a_rank_whose_workers_raised_exits_after_close(tmp_path: Path) -> None:
    """The rank prints the error and exits: `close` stopped the workers, whose iterator the
    error still refers to (before, the interpreter's exit waited for them forever)."""
    p = subprocess.run([sys.executable, "-c", FAILS, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "cannot skip batches" in p.stdout, p.stderr[-3000:]


# A rank (this script) reading through one worker; `term`: it stops on SIGTERM as a survivor
# under partial recovery does, reading on first; `kill`: its reader blocks inside batch 2 (a
# stalled file system), where the DataLoader's own check of its parent never runs.
RANK = """
import signal, sys, time
import torch
from trainer.data.loader import positioned_batches
from trainer.data.synthetic import SyntheticClickStream

class Stalls(SyntheticClickStream):
    def next_batch(self):
        if sys.argv[1] == "kill" and self.state_dict()["next_global_batch"] >= 2:
            time.sleep(600)
        return super().next_batch()

stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
reader = Stalls(feature_names=["a"], num_embeddings=[10], num_dense=1, batch_size=4, rank=0, world_size=1, seed=0)
batches = positioned_batches(reader, 1, prefetch=2, device=torch.device("cpu"))
next(batches); next(batches)
print("ready", flush=True)
if sys.argv[1] == "kill":
    time.sleep(600)
while not stop:
    next(batches)
    time.sleep(0.01)
for _ in range(3):
    next(batches)
print("read 3 batches after SIGTERM", flush=True)
batches.close()
"""


def _start_rank(mode: str) -> tuple[subprocess.Popen, int]:
    """The rank script in its own process group (as torchrun starts a rank), once it has read
    two batches; and its worker's pid."""
    p = subprocess.Popen(
        [sys.executable, "-c", RANK, mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready = threading.Event()
    threading.Thread(target=lambda: p.stdout.readline() == "ready\n" and ready.set(), daemon=True).start()  # type: ignore[union-attr]
    if not ready.wait(120):
        p.kill()
        pytest.fail(f"the rank script did not start: {p.communicate()[1][-2000:]}")
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    assert len(children) == 1, children
    return p, int(children[0])


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"  # exited, maybe not reaped
    except FileNotFoundError:
        return True


def test_sigterm_to_the_ranks_process_group_leaves_its_worker_reading() -> None:
    """torchrun signals a rank's whole process group: the worker ignores it, so a rank that
    finishes its step and saves (partial recovery) still gets batches, and exits cleanly."""
    p, worker = _start_rank("term")
    os.killpg(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    assert "read 3 batches after SIGTERM" in out
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling another process's state
    assert _gone(worker), "the worker outlived its rank's clean exit"


def test_a_worker_whose_rank_is_killed_exits_even_inside_a_read() -> None:
    p, worker = _start_rank("kill")
    try:
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling another process's state
        assert _gone(worker), "the worker outlived its SIGKILLed rank by 10 s"
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
