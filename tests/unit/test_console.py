"""The console: folding frequent checkpoint lines, the known-noise filters' precision, and the
claim one filter's reason rests on (fbgemm's data_parallel lookup has correct gradients)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from ckpt.events import CheckpointCommitted, CheckpointFailed, CheckpointSkipped
from launch.ranks import REPO
from trainer import console
from trainer.console import CheckpointDigest, CheckpointNote, ConsoleFormatter, ConsoleHandler


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def committed(cid: int, full: bool = False) -> CheckpointNote:
    return CheckpointNote(step=cid * 10, committed=True, checkpoint_id=cid, full=full, bytes=1_000_000, stall_ms=cid)


def test_checkpoints_far_apart_get_a_line_each() -> None:
    clock = FakeClock()
    digest = CheckpointDigest(window_s=2.0, hold_s=10.0, clock=clock)
    for cid in (1, 2, 3):
        assert digest.offer(committed(cid), f"line {cid}", "t") == [f"line {cid}"]
        clock.now += 2.5


def test_frequent_checkpoints_fold_into_one_line() -> None:
    clock = FakeClock()
    digest = CheckpointDigest(window_s=2.0, hold_s=10.0, clock=clock)
    assert digest.offer(committed(1, full=True), "line 1", "12:00:00") == ["line 1"]
    for cid in (2, 3, 4):
        clock.now += 0.5
        assert digest.offer(committed(cid, full=cid == 4), f"line {cid}", f"12:00:0{cid}") == []
    assert digest.flush() == ["12:00:04 checkpoints 2-4 committed (steps 20-40; 1 full, 2 delta): 3.00 MB, stall max 4.0 ms"]
    assert digest.flush() == []


def test_one_held_checkpoint_keeps_its_own_line() -> None:
    clock = FakeClock()
    digest = CheckpointDigest(window_s=2.0, hold_s=10.0, clock=clock)
    digest.offer(committed(1), "line 1", "t")
    clock.now += 1.0
    assert digest.offer(committed(2), "line 2", "t") == []
    assert digest.flush() == ["line 2"]


def test_held_checkpoints_are_printed_once_the_oldest_is_hold_s_old() -> None:
    clock = FakeClock()
    digest = CheckpointDigest(window_s=2.0, hold_s=10.0, clock=clock)
    digest.offer(committed(1), "line 1", "t")
    printed = []
    for cid in range(2, 40):
        clock.now += 1.0
        printed += digest.offer(committed(cid), f"line {cid}", "t")
    # held from checkpoint 2 (t+1); the one at t+11 is the first 10 s after it
    assert printed[0].startswith("t checkpoints 2-12 committed"), printed
    assert printed[1].startswith("t checkpoints 13-23 committed"), printed


def test_a_failed_checkpoint_is_never_held() -> None:
    clock = FakeClock()
    digest = CheckpointDigest(window_s=2.0, hold_s=10.0, clock=clock)
    digest.offer(committed(1), "line 1", "t")
    clock.now += 0.5
    digest.offer(committed(2), "line 2", "t")
    clock.now += 0.5
    failed = CheckpointNote(step=30, checkpoint_id=3)
    assert digest.offer(failed, "checkpoint 3 FAILED", "t") == ["line 2", "checkpoint 3 FAILED"]


def test_skipped_checkpoints_are_counted_in_the_folded_line() -> None:
    clock = FakeClock()
    digest = CheckpointDigest(window_s=2.0, hold_s=10.0, clock=clock)
    digest.offer(committed(1), "line 1", "t")
    for step in (2, 3, 4):
        clock.now += 0.1
        digest.offer(CheckpointNote(step=step, skipped=True), f"skipped {step}", "t")
    assert digest.flush() == ["t 3 checkpoint(s) skipped at steps 2-4: the writers are behind (ckpt.write.max_pending_bytes)"]


def committed_event(cid: int) -> CheckpointCommitted:
    """What the checkpointer attaches to its line for `committed(cid)` (ckpt/events.py)."""
    return CheckpointCommitted(
        step=cid * 10,
        ckpt_id=cid,
        ckpt_full=False,
        ckpt_rows=100,
        ckpt_bytes=1_000_000,
        ckpt_stall_ms=float(cid),
        ckpt_write_s=0.01,
        ckpt_error="",
    )


def test_another_line_prints_the_held_checkpoints_first(capsys: pytest.CaptureFixture[str]) -> None:
    """Order on the console is the order of events: held checkpoints come out before the next line."""
    clock = FakeClock()
    logger = logging.getLogger("ckpt.test_console_order")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = ConsoleHandler(ConsoleFormatter(rank=0, verbose=False), CheckpointDigest(clock=clock))
    logger.addHandler(handler)
    try:
        for cid in (1, 2, 3):
            logger.info("checkpoint %d committed", cid, extra={"ckpt": committed_event(cid)})
            clock.now += 0.5
        logger.info("step 30/30: loss 0.5")
    finally:
        logger.removeHandler(handler)
    lines = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "checkpoint 1 committed",
        "checkpoints 2-3 committed (steps 20-30; 0 full, 2 delta): 2.00 MB, stall max 3.0 ms",
        "step 30/30: loss 0.5",
    ]


def test_the_note_of_each_checkpoint_event() -> None:
    def note(event: object) -> CheckpointNote | None:
        record = logging.LogRecord("ckpt.manager", logging.INFO, "manager.py", 1, "line", None, None)
        record.ckpt = event
        return CheckpointNote.of(record)

    assert note(committed_event(3)) == committed(3)
    failed = CheckpointFailed(
        step=30, ckpt_id=3, ckpt_full=True, ckpt_rows=0, ckpt_bytes=0, ckpt_stall_ms=2.0, ckpt_write_s=0.0, ckpt_error="x"
    )
    assert note(failed) == CheckpointNote(step=30, checkpoint_id=3, full=True, stall_ms=2.0)
    assert note(CheckpointSkipped(step=40)) == CheckpointNote(step=40, skipped=True)
    assert note({"step": 40, "skipped": True}) is None  # only events carry a note
    assert note(None) is None


def _probe(verbose: bool) -> str:
    """Run a fresh interpreter that sets up rank 0's console and emits listed noise and
    look-alikes that are not listed; its stderr."""
    script = textwrap.dedent(f"""
        import logging, warnings
        from trainer import console
        console.setup_rank(0, verbose={verbose})
        def warn_from(module, message, category):
            exec("import warnings; warnings.warn(MESSAGE, CATEGORY)",
                 {{"__name__": module, "MESSAGE": message, "CATEGORY": category}})
        warn_from("torchrec.distributed.embeddingbag", "`broadcast_buffers` is deprecated. listed", FutureWarning)
        warn_from("deltarec_probe", "`broadcast_buffers` is deprecated. other module", FutureWarning)
        warn_from("torchrec.distributed.embeddingbag", "`broadcast_buffers` is deprecated. other category", UserWarning)
        warn_from("torchrec.distributed.embeddingbag", "something else entirely", FutureWarning)
        logging.getLogger("torchrec.distributed.comm").warning("TORCHREC_RESOLVED_POD_SIZE not set, listed")
        logging.getLogger("torchrec.distributed.comm").warning("a comm warning nobody listed")
        logging.getLogger("torchrec.distributed.utils").warning("TORCHREC_RESOLVED_POD_SIZE not set, other logger")
        logging.getLogger("ckpt.manager").info("deltarec's own line")
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stderr


def test_a_filter_drops_only_the_message_it_names() -> None:
    err = _probe(verbose=False)
    assert "listed" not in err.replace("nobody listed", "")
    for shown in ("other module", "other category", "something else entirely", "a comm warning nobody listed",
                  "other logger", "deltarec's own line"):  # fmt: skip
        assert shown in err, (shown, err)


def test_verbose_installs_no_filter() -> None:
    err = _probe(verbose=True)
    for shown in ("broadcast_buffers` is deprecated. listed", "TORCHREC_RESOLVED_POD_SIZE not set, listed"):
        assert shown in err, (shown, err)


def test_every_filter_gives_its_reason() -> None:
    for entry in (*console.TRAINER_NOISE, *console.CUDA_NOISE, *console.LAUNCHER_NOISE, *console.EXPORT_NOISE):
        assert len(entry.reason.split()) >= 5, entry


def test_fbgemm_dense_lookup_warns_yet_its_gradients_are_right() -> None:
    """The reason the fbgemm warning is filtered: the data_parallel kernel's backward is
    correct although torch's autograd fallback says it may not be."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    rows, dim = 10, 4
    lookup = DenseTableBatchedEmbeddingBagsCodegen([(rows, dim)], use_cpu=True)
    indices = torch.tensor([1, 2, 2, 7, 3])
    offsets = torch.tensor([0, 3, 5])  # bags [1, 2, 2] and [7, 3]
    weights_out = torch.randn(2, dim, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (lookup(indices, offsets) * weights_out).sum().backward()
    assert any("fbgemm::dense_embedding_codegen_lookup_function" in str(w.message) for w in caught)

    table = lookup.weights.detach().view(rows, dim).clone().requires_grad_()
    expected = torch.nn.functional.embedding_bag(indices, table, offsets, mode="sum", include_last_offset=True)
    (expected * weights_out).sum().backward()
    assert torch.allclose(lookup.weights.grad.view(rows, dim), table.grad)
    assert table.grad.abs().sum() > 0


GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13699: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def _record(msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("ckpt.write.writer", logging.ERROR, "writer.py", 1, msg, None, exc_info)


def test_what_counts_as_a_peer_gone() -> None:
    assert console.is_peer_lost(RuntimeError(GLOO_RESET))
    assert not console.is_peer_lost(RuntimeError("KafkaError: Connection reset by peer (broker 1)"))
    assert not console.is_peer_lost(ValueError(GLOO_RESET))
    traceback_text = f"checkpoint 3: writer failed: Traceback (most recent call last):\n  ...\nRuntimeError: {GLOO_RESET}\n"
    assert console.reports_peer_lost(_record(traceback_text))
    assert console.reports_peer_lost(_record("checkpoint 3: writer failed", RuntimeError(GLOO_RESET)))
    assert not console.reports_peer_lost(_record("librdkafka: 127.0.0.1:9092: Connection reset by peer"))
    assert console.peer_lost_line(0, RuntimeError(GLOO_RESET)) == (
        "deltarec-train: rank 0 stopped: another rank of the job is gone (Connection reset by peer)"
    )


GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
    "Timed out waiting 5000ms for send operation to complete"
)


def _train_step_that_stalls() -> None:
    raise RuntimeError(GLOO_TIMEOUT)


def test_a_timed_out_collective_is_one_line_with_the_wait_and_where() -> None:
    try:
        _train_step_that_stalls()
    except RuntimeError as exc:
        caught = exc
    assert console.is_stalled_collective(caught) and not console.is_peer_lost(caught)
    line = console.stalled_line(1, caught)
    assert line.startswith(
        "deltarec-train: rank 1 stopped: a collective waited 5 s (sharding.timeout_s) for a rank that does not answer: "
    )
    # no torchrec or torch.distributed frame here: the innermost frame outside the libraries
    assert line.endswith(
        "_train_step_that_stalls (unit/test_console.py:" + str(_train_step_that_stalls.__code__.co_firstlineno + 1) + ")"
    ), line
    assert not console.is_stalled_collective(RuntimeError("Timed out waiting 5000ms for the broker"))
    assert not console.is_stalled_collective(RuntimeError(GLOO_RESET))
    # an operation on a connection an earlier one timed out on (seen in torchrec's input all-to-all)
    closed = RuntimeError("Application timeout caused pair closure")
    assert console.is_stalled_collective(closed) and not console.is_peer_lost(closed)
    assert "a collective waited the timeout (sharding.timeout_s)" in console.stalled_line(0, closed)
    # gloo's pair-closure message has no figure: the configured timeout stands in for it
    assert "a collective waited 5 s (sharding.timeout_s)" in console.stalled_line(0, closed, timeout_s=5.0)


def test_a_collective_timed_out_in_the_backward_pass_names_it() -> None:
    # DDP's reducer waits for the gradient all-reduce in C++: autograd's frame is the innermost library one
    autograd = compile("def _engine_run_backward(step):\n    step()\n", "/venv/site-packages/torch/autograd/graph.py",
                       "exec")  # fmt: skip
    scope: dict = {}
    exec(autograd, scope)
    try:
        scope["_engine_run_backward"](_train_step_that_stalls)
    except RuntimeError as exc:
        caught = exc
    line = console.stalled_line(0, caught)
    assert (": the backward pass's gradient all-reduce or all-to-all, _engine_run_backward (autograd/graph.py:2) in "
            "_train_step_that_stalls (unit/test_console.py:") in line, line  # fmt: skip


def test_a_repeated_library_message_shows_once_a_window_with_the_count() -> None:
    now = [0.0]
    f = console.RepeatFilter(60.0, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("deltarec.librdkafka", logging.ERROR, "x", 1, msg, None, None)

    refused = "FAIL [rdkafka#producer-{}]: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after {}ms)"
    assert f.filter(rec(refused.format(1, 0)))
    now[0] = 10.0
    assert not f.filter(rec(refused.format(1, 3)))  # the same but for its numbers
    assert f.filter(rec("FAIL: Receive failed: Disconnected"))  # another message
    now[0] = 59.0
    assert not f.filter(rec(refused.format(2, 1)))
    now[0] = 61.0
    later = rec(refused.format(1, 2))
    assert f.filter(later) and later.getMessage().endswith("(after 2ms) (2 more like it in the last 60 s)")
