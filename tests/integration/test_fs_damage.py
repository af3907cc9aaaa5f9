"""Filesystem sink damage: a frame duplicated inside a range a COMMIT marker
names, a frame duplicated after the last named offset, a segment deleted. Real gloo ranks,
real files. (A segment cut mid-frame: test_sinks.py::test_fs_torn_tail_is_ignored_and_cut_by_the_next_writer.)

One job is trained for the whole file: checkpoints 1 (full) and 2 (delta) in generation 1,
then, after a resume, checkpoint 3 (a delta) in generation 3 of its own, so checkpoint 2's
chain does not use checkpoint 3's segments. Frames are capped at 16 KiB, so a shard is
several frames of one size: a duplicate inside a range leaves the range's end on a record
start, and only the frames' chunk numbers tell it apart from the frames the marker names.

Spawns are what the file costs (each ~5 s of imports), so the two damages that must fail
share one copy and one pair of runs: a table-wise restore reads each partition on its own
rank, the duplicate is in partition 0 (rank 0), the deleted segment is partition 1's (rank
1), and each rank has to find and name its own damage.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt import cli as ckpt_cli
from ckpt.log.catalog import commits
from ckpt.log.markers import Marker
from ckpt.stream.filesystem import REC_MAGIC, FsMarkers
from ckpt.stream.frames import decode_frame
from launch.ranks import RankResult, spawn_ranks
from sharding.plan import table_key
from trainer.ckpt_cli import load_job_ckpt_config

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

pytestmark = pytest.mark.integration

_HEAD = struct.Struct("<4sII")  # a segment record: magic, payload length, crc32 (ckpt/stream/filesystem.py)
TRAIN_ERROR_RC = 2  # `deltarec-train: error: ...`
FALL_BACK = "falling back to the previous checkpoint"
RESUME = ["ckpt.restore.resume=latest", "train.steps=30"]
FALL_BACK_TO_2 = ["ckpt.restore.resume=latest", "ckpt.restore.on_corrupt=previous", "train.steps=20"]


@dataclass(frozen=True)
class Trained:
    config: Path  # the debug config the job ran with
    run: Path  # the pristine run directory (never damaged: the copies' markers name its dense files)
    run_id: str
    job: list[str]  # the job's overrides, as every spawn and the CLI get them
    newest: Marker  # checkpoint 3: chain [1, 2, 3] in generations [1, 1, 3]
    previous: Marker  # checkpoint 2: chain [1, 2], all in generation 1


def _markers(run: Path, run_id: str) -> dict[int, Marker]:
    return {m.checkpoint_id: m for _, m in commits(FsMarkers(run / "stream", run_id).read_markers(), run_id)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, debug_config: DebugConfig) -> Trained:
    """Train 20 steps (checkpoints 1 and 2), resume and train to 30 (checkpoint 3). Each stage
    dumps its parameters: params-ckpt2/ and params/ hold exactly what checkpoints 2 and 3 hold."""
    root = tmp_path_factory.mktemp("fs-damage")
    run_id = f"fsdamage-{uuid.uuid4().hex[:8]}"
    job = [f"ckpt.{k}={v}" for k, v in {
        "enabled": "true", "sink": "filesystem", "run_id": run_id, "policy": "incremental", "interval_steps": 10,
        "flush_timeout_s": 20, "max_frame_bytes": 16384,
    }.items()] + ["train.eval_batches=1", "train.save_params=true"]  # fmt: skip
    spawn_ranks(debug_config.path, [*job, "train.steps=20"], root)
    run = root / "run"
    (run / "params").rename(run / "params-ckpt2")
    resumed = spawn_ranks(debug_config.path, [*job, *RESUME], root)
    assert "resumed from checkpoint 2 at step 20" in resumed[0].stdout, resumed[0].stdout
    markers = _markers(run, run_id)
    assert sorted(markers) == [1, 2, 3]
    newest, previous = markers[3], markers[2]
    assert [(link.checkpoint_id, link.full, link.generation) for link in newest.chain] == \
        [(1, True, 1), (2, False, 1), (3, False, 3)]  # fmt: skip
    assert [link.generation for link in previous.chain] == [1, 1]
    # table-wise: t_user is rank 0's (partition 0), t_item and t_ctx rank 1's (partition 1)
    assert {(e.table, e.partition) for e in newest.chain[-1].index} == {
        (table_key("t_user"), 0),
        (table_key("t_item"), 1),
        (table_key("t_ctx"), 1),
    }
    return Trained(debug_config.path, run, run_id, job, newest, previous)


def _copy(trained: Trained, dest: Path) -> Path:
    """A copy of the trained run directory at dest/run (where spawn_ranks puts run.dir),
    without the parameter dumps a restore must write afresh."""
    run = dest / "run"
    shutil.copytree(trained.run, run)
    shutil.rmtree(run / "params")
    return run


def _segment(run: Path, run_id: str, generation: int, partition: int) -> Path:
    return run / "stream" / f"{run_id}.rows.g{generation}" / f"{partition}.seg"


def _record(data: bytes, pos: int) -> bytes:
    """The whole segment record (header and frame) that starts at byte `pos`."""
    magic, length, _ = _HEAD.unpack_from(data, pos)
    assert magic == REC_MAGIC, f"no record starts at byte {pos}"
    return data[pos : pos + _HEAD.size + length]


def _dumps(run: Path, name: str = "params") -> list[dict[str, torch.Tensor]]:
    return [torch.load(run / name / f"rank{r}.pt") for r in range(2)]


def _assert_bit_identical(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], what: str) -> None:
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert sorted(g) == sorted(w), f"rank {rank}: other tensors than {what}"
        differ = [k for k in w if not torch.equal(g[k], w[k])]
        assert not differ, f"rank {rank}: {differ} differ from {what}"


def _verify(trained: Trained, run: Path, *checkpoint: str) -> tuple[int, str]:
    """`deltarec-ckpt verify [--checkpoint N]` on `run`, in this process: (exit status, output)."""
    out = io.StringIO()
    argv = ["--config", str(trained.config), f"run.dir={run}", *trained.job, "verify", *checkpoint]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = ckpt_cli.main(argv, load_job_ckpt_config)
    return rc, out.getvalue()


@dataclass(frozen=True)
class Damaged:
    """One copy with both damages, resumed twice (`resume=latest`, then with
    `on_corrupt=previous`), and what `deltarec-ckpt verify` said of each damage."""

    run: Path
    duplicate: str  # what a reader must say of the duplicated frame (file, byte offset, why)
    missing: str  # ... of the deleted segment (file, the bytes it had to read)
    failed: list[RankResult]
    fell_back: list[RankResult]
    verify_duplicate: tuple[int, str]  # newest checkpoint, both damages in place
    verify_missing: tuple[int, str]  # newest checkpoint, the duplicate undone
    verify_previous: tuple[int, str]  # checkpoint 2, both damages in place


@pytest.fixture(scope="module")
def damaged(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Damaged:
    dest = tmp_path_factory.mktemp("damaged")
    run = _copy(trained, dest)
    link = trained.newest.chain[-1]

    # partition 0: one whole record of checkpoint 3's t_user frames inserted right after itself
    (user,) = [e for e in link.index if e.table == table_key("t_user")]
    dup_seg = _segment(run, trained.run_id, link.generation, user.partition)
    pristine = dup_seg.read_bytes()
    first = _record(pristine, user.first)
    dup_at = user.first + len(first)
    assert dup_at <= user.last, "checkpoint 3 wrote t_user in one frame: nothing to duplicate inside its range"
    damaged_bytes = pristine[:dup_at] + first + pristine[dup_at:]
    _record(damaged_bytes, user.last)  # the range still ends on a record start: only the frames' contents tell
    dup_seg.write_bytes(damaged_bytes)
    frame = decode_frame(first[_HEAD.size :])
    assert (frame.checkpoint_id, frame.table, frame.chunk_index) == (3, table_key("t_user"), 0)
    n = frame.chunk_count
    duplicate = (
        f"{dup_seg} at byte {dup_at}: frame is chunk 0 of {n} of shard {table_key('t_user')}@0, expected chunk 1 of {n}: "
        "a frame duplicated, missing or out of order in the range its COMMIT marker names"
    )

    # partition 1: checkpoint 3's segment deleted (generation 3 holds nothing of checkpoint 2)
    assert link.generation not in {lk.generation for lk in trained.previous.chain}
    entries = [e for e in link.index if e.partition == 1]
    gone = _segment(run, trained.run_id, link.generation, 1)
    gone.unlink()
    missing = f"segment {gone} does not exist (reading bytes {entries[0].first}..{entries[-1].last})"

    failed = spawn_ranks(trained.config, [*trained.job, *RESUME], dest, expect_ok=False)
    fell_back = spawn_ranks(trained.config, [*trained.job, *FALL_BACK_TO_2], dest)
    verify_duplicate = _verify(trained, run)
    verify_previous = _verify(trained, run, "--checkpoint", "2")
    dup_seg.write_bytes(pristine)  # verify stops at the first damage: undo the duplicate to see the deletion
    verify_missing = _verify(trained, run)
    return Damaged(run, duplicate, missing, failed, fell_back, verify_duplicate, verify_missing, verify_previous)


def _assert_fails_naming(result: RankResult, reason: str) -> None:
    """The rank stopped with the trainer's error status naming `reason`, resuming nothing."""
    assert result.returncode == TRAIN_ERROR_RC and "resumed from" not in result.stdout, result.stderr[-3000:]
    error = f"deltarec-train: error: checkpoint 3: {reason} (set ckpt.restore.on_corrupt=previous to fall back"
    assert error in result.stderr, result.stderr[-3000:]


def _assert_fell_back(damaged: Damaged, trained: Trained, rank: int, reason: str) -> None:
    """With `on_corrupt=previous` the rank said why it left checkpoint 3, and every rank holds
    checkpoint 2 exactly as the job that wrote it did."""
    assert "resumed from checkpoint 2 at step 20" in damaged.fell_back[0].stdout, damaged.fell_back[0].stdout
    lines = damaged.fell_back[rank].stderr.splitlines()
    assert any(line.endswith(f"checkpoint 3: {reason}; {FALL_BACK}") for line in lines), "\n".join(lines[-20:])
    _assert_bit_identical(_dumps(damaged.run), _dumps(trained.run, "params-ckpt2"), "checkpoint 2's job")


def test_frame_duplicated_inside_a_named_range_fails_naming_file_and_offset_or_falls_back(damaged: Damaged, trained: Trained):
    _assert_fails_naming(damaged.failed[0], damaged.duplicate)
    rc, out = damaged.verify_duplicate
    assert rc == 1 and f"deltarec-ckpt: error: {damaged.duplicate}" in out, out
    rc, out = damaged.verify_previous
    assert rc == 0 and "checkpoint 2 (step 20): OK" in out, out
    _assert_fell_back(damaged, trained, 0, damaged.duplicate)


def test_deleted_segment_fails_naming_it_or_falls_back_to_a_chain_without_it(damaged: Damaged, trained: Trained):
    _assert_fails_naming(damaged.failed[1], damaged.missing)
    rc, out = damaged.verify_missing
    assert rc == 1 and f"deltarec-ckpt: error: {damaged.missing}" in out, out
    _assert_fell_back(damaged, trained, 1, damaged.missing)


def test_frame_duplicated_after_the_last_named_offset_is_ignored(trained: Trained, tmp_path: Path):
    """A retried or zombie append: every segment gets a copy of its last record at its end,
    after the last offset any marker names (checkpoint 2's in generation 1, 3's in 3)."""
    run = _copy(trained, tmp_path)
    for link in trained.newest.chain[1:]:
        for partition, ranges in link.ranges.items():
            seg = _segment(run, trained.run_id, link.generation, partition)
            data = seg.read_bytes()
            last = _record(data, max(r.last for r in ranges))
            assert data.endswith(last), f"{seg}: a record follows the last one checkpoint {link.checkpoint_id} names"
            seg.write_bytes(data + last)

    results = spawn_ranks(trained.config, [*trained.job, *RESUME], tmp_path)
    assert "resumed from checkpoint 3 at step 30" in results[0].stdout, results[0].stdout
    _assert_bit_identical(_dumps(run), _dumps(trained.run), "checkpoint 3's job")
    rc, out = _verify(trained, run)
    assert rc == 0 and "checkpoint 3 (step 30): OK" in out, out
