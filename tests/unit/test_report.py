"""The run report (`deltarec-report`) and the TensorBoard copy of metrics.jsonl.

The report reads a metrics.jsonl written here (a resumed run with full, delta, failed and
skipped checkpoints and a restore), so every number it prints is known in advance; bad input
must end in one `deltarec-report: error:` line naming the file and line. Files written before
records carried their event's name (`"event"`, ckpt/events.py) must give the same report as
before; the records below are in that old form unless a test writes them through `MetricsLog`."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.image import imread
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from ckpt.events import read_event
from common.errors import ConfigError
from trainer.metrics import MetricsLog
from trainer.report import figure, main, read_metrics, summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def window(step: int, loss: float) -> dict[str, Any]:
    return {"step": step, "loss": loss, "samples_per_s": 1000.0}


def evaluation(step: int, auc: float, logloss: float) -> dict[str, Any]:
    return {"step": step, "eval_auc": auc, "eval_logloss": logloss, "eval_samples": 1024}


def ckpt(
    step: int, cid: int, full: bool, nbytes: int, stall_ms: float, encoding: str, durable_s: float | None, committed: bool = True
) -> dict[str, Any]:
    return {
        "step": step,
        "ckpt_id": cid,
        "ckpt_committed": committed,
        "ckpt_full": full,
        "ckpt_rows": nbytes // 10,
        "ckpt_bytes": nbytes,
        "ckpt_stall_ms": stall_ms,
        "ckpt_write_s": 0.01,
        "ckpt_error": "" if committed else "broker unreachable",
        "ckpt_encoding": encoding,
        "ckpt_durable_s": durable_s,
    }


# A run that crashed after step 60 and resumed from checkpoint 4 (step 50): steps 60 repeat.
RESUMED = [
    window(10, 0.69),
    ckpt(10, 1, True, 1000, 5.0, "fp32", 0.5),
    window(20, 0.60),
    evaluation(20, 0.70, 0.60),
    ckpt(20, 2, False, 300, 1.0, "adaptive4", 0.2),
    {"step": 30, "ckpt_skipped": True},
    window(30, 0.55),
    ckpt(40, 3, False, 200, 2.0, "adaptive4", None, committed=False),
    window(40, 0.50),
    ckpt(50, 4, True, 1200, 6.0, "fp32", 0.9),
    window(50, 0.48),
    window(60, 0.47),
    {"step": 50, "restored_ckpt": 4, "restore_s": 0.25, "restore_bytes": 1200, "restore_chain": [4]},
    window(60, 0.46),
    window(70, 0.44),
    ckpt(60, 5, False, 400, 1.5, "adaptive4", 0.3),
    evaluation(70, 0.75, 0.52),
]


# The same kind of run with exactly the key sets the code wrote before records named their event
# (ckpt/checkpointer.py's checkpoint, skip, restore and partial-restore records, trainer/trainer.py's
# windows and evaluations): a file of that age must load and give the report it gave then.
def full_ckpt(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {**ckpt(*args, **kwargs), "ckpt_stall_new_bytes": 4096}


def full_restore(step: int, cid: int, chain: list[int], nbytes: int, seconds: float) -> dict[str, Any]:
    return {
        "step": step,
        "restored_ckpt": cid,
        "restore_s": seconds,
        "restore_bytes": nbytes,
        "restore_chain": chain,
        "restore_rows_written": 120,
        "restore_markers_s": 0.01,
        "restore_markers_records": 7,
        "restore_markers_ahead_s": 0.0,
        "restore_read_ahead_ranks": 2,
        "restore_dense_ahead_ranks": 2,
        "restore_fetch_s": 0.05,
        "restore_decode_s": 0.02,
        "restore_apply_s": 0.03,
        "restore_dense_s": 0.04,
        "restore_regenerated_rows": 0,
        "restore_regenerate_s": 0.0,
        "run_pls": 0.0,
    }


PARTIAL = {
    "step": 55,
    "partial_restore": True,
    "partial_kept_ranks": [0],
    "partial_rolled_back_ranks": [1],
    "partial_rolled_back_fraction": 0.5,
    "partial_rolled_back_tables": {"t0": 0.5},
    "partial_samples_since_ckpt": 640,
    "partial_lost_samples": 320.0,
    "partial_waiting_lost": 0.0,
    "run_pls": 0.01,
}
OLD_FORMAT = [
    window(10, 0.69),
    full_ckpt(10, 1, True, 1000, 5.0, "fp32", 0.5),
    window(20, 0.60),
    evaluation(20, 0.70, 0.60),
    full_ckpt(20, 2, False, 300, 1.0, "adaptive4", 0.2),
    {"step": 30, "ckpt_skipped": True},
    window(30, 0.55),
    full_ckpt(40, 3, False, 200, 2.0, "adaptive4", None, committed=False),
    window(40, 0.50),
    full_ckpt(50, 4, True, 1200, 6.0, "fp32", 0.9),
    window(50, 0.48),
    window(60, 0.47),
    full_restore(50, 4, [4], 1200, 0.25),
    PARTIAL,
    window(60, 0.46),
    window(70, 0.44),
    full_ckpt(60, 5, False, 400, 1.5, "adaptive4", 0.3),
    full_ckpt(70, 6, True, 1500, 7.0, "fp32", 1.1),
    evaluation(70, 0.75, 0.52),
]
OLD_FORMAT_SUMMARY = [  # what deltarec-report printed for OLD_FORMAT before records were typed events
    "trained to step 70 over 2 attempts",
    "final eval (step 70): AUC 0.7500, log loss 0.5200",
    "checkpoints: 5 committed, 1 failed, 1 skipped",
    "bytes committed: 4.40 kB (full 3.70 kB, delta 700 B; adaptive4 700 B, fp32 3.70 kB)",
    "stall per checkpoint: median 3.5 ms, max 7.0 ms",
    "time to COMMIT: median 0.50 s, max 1.10 s",
    "restores: 1: checkpoint 4 at step 50 (chain [4], 1.20 kB in 0.25 s)",
]


def write_run(run_dir: Path, records: list[dict[str, Any]]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_report(debug_config, run_dir: Path, *extra: str) -> int:
    return main(["--config", str(debug_config.path), f"run.dir={run_dir}", *extra])


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_summary_numbers_of_a_resumed_run(tmp_path: Path) -> None:
    m = read_metrics(write_run(tmp_path, RESUMED))
    assert [[w.step for w in a.windows] for a in m.attempts] == [[10, 20, 30, 40, 50, 60], [60, 70]]
    assert m.attempts[1].restore is not None and m.attempts[1].restore.restore_chain == (4,)
    s = summarize(m)
    assert (s.final_step, s.attempts) == (70, 2)
    assert s.final_eval is not None and (s.final_eval.step, s.final_eval.eval_auc, s.final_eval.eval_logloss) == (70, 0.75, 0.52)
    assert (s.committed, s.failed, s.skipped) == (4, 1, 1)
    assert (s.full_bytes, s.delta_bytes, s.total_bytes) == (2200, 700, 2900)  # the failed checkpoint's 200 left out
    assert s.bytes_by_encoding == {"fp32": 2200, "adaptive4": 700}
    assert s.stall_ms == (2.0, 6.0)  # over 5, 1, 2, 6, 1.5: the failed checkpoint stalled training too
    assert s.durable_s == pytest.approx((0.4, 0.9))  # committed ones: 0.5, 0.2, 0.9, 0.3
    assert [(r.restored_ckpt, r.step) for r in s.restores] == [(4, 50)]


def test_cli_writes_the_png_and_prints_the_summary(tmp_path: Path, debug_config, capsys) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, RESUMED)
    assert run_report(debug_config, run_dir) == 0
    out, err = capsys.readouterr()
    png = run_dir / "report.png"
    assert out.splitlines() == [
        "trained to step 70 over 2 attempts",
        "final eval (step 70): AUC 0.7500, log loss 0.5200",
        "checkpoints: 4 committed, 1 failed, 1 skipped",
        "bytes committed: 2.90 kB (full 2.20 kB, delta 700 B; adaptive4 700 B, fp32 2.20 kB)",
        "stall per checkpoint: median 2.0 ms, max 6.0 ms",
        "time to COMMIT: median 0.40 s, max 0.90 s",
        "restores: 1: checkpoint 4 at step 50 (chain [4], 1.20 kB in 0.25 s)",
        f"report: {png}",
    ]
    assert err == ""
    width, height = png_size(png)
    assert 800 <= width <= 3000 and 800 <= height <= 3000, (width, height)
    pixels = imread(png)
    assert pixels.shape[:2] == (height, width) and pixels.std() > 0.01  # decodes, and is not blank


def test_every_step_panel_marks_the_restore_and_failed_skipped_are_told_apart(tmp_path: Path) -> None:
    fig = figure(read_metrics(write_run(tmp_path, RESUMED)), "t")
    with_restore = [
        ax for ax in fig.axes if any(isinstance(ln, Line2D) and list(ln.get_xdata()) == [50, 50] for ln in ax.get_lines())
    ]
    assert len(with_restore) == 4  # loss/AUC, bytes, stall, time to COMMIT
    bytes_ax = with_restore[1]
    bars = [p for p in bytes_ax.patches if isinstance(p, Rectangle)]
    assert sorted(b.get_height() for b in bars) == [200, 300, 400, 1000, 1200]
    labels = {t.get_text() for t in bytes_ax.get_legend().get_texts()}
    assert {
        "full",
        "delta",
        "encoding adaptive4",
        "encoding fp32",
        "failed (never committed)",
        "skipped (writers behind)",
    } <= labels
    loss_labels = {t.get_text() for t in with_restore[0].get_legend().get_texts()}
    assert any("trained again" in t for t in loss_labels)  # attempt 1's step 60, redone after the restore


def test_run_without_checkpoints_has_only_the_loss_panel(tmp_path: Path, debug_config, capsys) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, [window(10, 0.7), window(20, 0.6), evaluation(20, 0.71, 0.58)])
    assert run_report(debug_config, run_dir) == 0
    out = capsys.readouterr().out.splitlines()
    assert "checkpoints: no checkpoints" in out and "restores: none" in out
    assert not any(line.startswith(("bytes", "stall", "time to COMMIT")) for line in out)
    width, height = png_size(run_dir / "report.png")
    assert height < width  # one panel, not four
    fig = figure(read_metrics(run_dir / "metrics.jsonl"), "t")
    assert "no checkpoints" in fig.axes[0].get_title(loc="left")


def test_older_run_without_encoding_or_time_to_commit(tmp_path: Path, debug_config, capsys) -> None:
    old = [{k: v for k, v in r.items() if k not in ("ckpt_encoding", "ckpt_durable_s")} for r in RESUMED[:6]]
    run_dir = tmp_path / "run"
    write_run(run_dir, old)
    assert run_report(debug_config, run_dir) == 0
    out = capsys.readouterr().out.splitlines()
    assert "bytes committed: 1.30 kB (full 1.00 kB, delta 300 B)" in out
    assert not any(line.startswith("time to COMMIT") for line in out)
    assert summarize(read_metrics(run_dir / "metrics.jsonl")).durable_s is None


def test_a_file_written_before_events_gives_the_same_report(tmp_path: Path, debug_config, capsys) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, OLD_FORMAT)
    assert run_report(debug_config, run_dir) == 0
    assert capsys.readouterr().out.splitlines() == [*OLD_FORMAT_SUMMARY, f"report: {run_dir / 'report.png'}"]


def test_a_file_written_as_events_gives_the_same_report(tmp_path: Path, debug_config, capsys) -> None:
    """The old file's records read as events and written by the metrics log (with `"event"`):
    every old key is still there with its value, the events read back equal, the report is the same."""
    events = [read_event(r) for r in OLD_FORMAT]
    run_dir = tmp_path / "run"
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=True)
    for e in events:
        log.write(e)
    log.close()
    written = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r.items() <= w.items() and w["event"] == e.kind for r, w, e in zip(OLD_FORMAT, written, events, strict=True))
    assert [read_event(w) for w in written] == events
    assert run_report(debug_config, run_dir) == 0
    assert capsys.readouterr().out.splitlines() == [*OLD_FORMAT_SUMMARY, f"report: {run_dir / 'report.png'}"]


def test_kinds_the_report_does_not_know_are_passed_over(tmp_path: Path) -> None:
    """Today's rule, kept: a record of another kind (a newer deltarec's, old or new form) is
    skipped as long as it has an integer step; partial restores and the follower's records too."""
    follower = {"step": 20, "export_ckpt": 2, "export_path": "/x/model.pt", "export_s": 0.1}
    records = [
        window(10, 0.7),
        {"step": 5, "a_future_kind": 1},
        {"event": "a_future_kind", "step": 6, "x": [1]},
        PARTIAL,
        follower,
    ]
    m = read_metrics(write_run(tmp_path, [*records, window(20, 0.6)]))
    assert [[w.step for w in a.windows] for a in m.attempts] == [[10, 20]]
    assert (m.checkpoints, m.evals, m.restores, m.skipped) == ([], [], [], [])


def test_steps_going_back_without_a_restore_record_start_a_new_attempt(tmp_path: Path) -> None:
    records = [window(10, 0.7), window(20, 0.6), {"step": 5, "a_future_kind": 1}, window(10, 0.7), window(20, 0.6)]
    m = read_metrics(write_run(tmp_path, records))
    assert [[w.step for w in a.windows] for a in m.attempts] == [[10, 20], [10, 20]]
    assert m.restores == []


def test_out_option_writes_elsewhere(tmp_path: Path, debug_config, capsys) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, RESUMED)
    out_png = tmp_path / "elsewhere.png"
    assert run_report(debug_config, run_dir, "--out", str(out_png)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"report: {out_png}"
    png_size(out_png)
    assert not (run_dir / "report.png").exists()


GOOD = json.dumps(window(10, 0.7))
BAD_INPUT = {
    "truncated JSON": (f'{GOOD}\n{{"step": 20, "loss"\n', ":2: not a JSON record"),
    "empty line": (f"{GOOD}\n\n{GOOD}\n", ":2: empty line"),
    "not an object": ("[1, 2]\n", ":1: expected a JSON object"),
    "missing field": (
        json.dumps({k: v for k, v in RESUMED[1].items() if k != "ckpt_bytes"}) + "\n",
        ":1: metrics record has no 'ckpt_bytes' field",
    ),
    "wrong type": (json.dumps({**window(10, 0.7), "loss": "low"}) + "\n", ":1: 'loss' must be a number"),
    "no records": ("", ": no metrics records yet"),
    "unknown kind without a step": (json.dumps({"a_future_kind": 1}) + "\n", ":1: metrics record has no 'step' field"),
    "event name not a string": (json.dumps({**window(10, 0.7), "event": 3}) + "\n", ":1: 'event' must be a string"),
    "new form, missing field": (
        json.dumps({"event": "checkpoint_committed", **RESUMED[1], "ckpt_rows": None}) + "\n",
        ":1: 'ckpt_rows' must be an integer, got None",
    ),
    "old form, committed not a flag": (
        json.dumps({**RESUMED[1], "ckpt_committed": "yes"}) + "\n",
        ":1: 'ckpt_committed' must be true or false",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_metrics_line_is_one_error_line_naming_file_and_line(name: str, tmp_path: Path, debug_config, capsys) -> None:
    text, expected = BAD_INPUT[name]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(text)
    assert run_report(debug_config, run_dir) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("deltarec-report: error: "), err
    assert f"{run_dir / 'metrics.jsonl'}{expected}" in err
    assert not (run_dir / "report.png").exists()


@pytest.mark.parametrize("case", ["no metrics file", "no config file", "unwritable output"])
def test_user_errors_outside_the_metrics_are_one_line(case: str, tmp_path: Path, debug_config, capsys) -> None:
    run_dir = tmp_path / "run"
    if case == "no metrics file":
        rc, expected = run_report(debug_config, run_dir), f"{run_dir / 'metrics.jsonl'}: no metrics file"
    elif case == "no config file":
        missing = tmp_path / "nope.yaml"
        rc, expected = main(["--config", str(missing)]), f"config file not found: {missing}"
    else:
        write_run(run_dir, RESUMED)
        out_png = tmp_path / "missing-dir" / "r.png"
        rc, expected = run_report(debug_config, run_dir, "--out", str(out_png)), f"cannot write the report to {out_png}"
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("deltarec-report: error: ") and expected in err, err


def test_python_dash_m_runs_the_report(tmp_path: Path, debug_config, run_cli) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, RESUMED)
    result = run_cli("trainer.report", "--config", debug_config.path, f"run.dir={run_dir}")
    assert "checkpoints: 4 committed, 1 failed, 1 skipped" in result.stdout.splitlines()
    png_size(run_dir / "report.png")


# --- TensorBoard --------------------------------------------------------------------------------


def test_tensorboard_scalars_equal_the_records(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tensorboard"
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True, tensorboard_dir=tb_dir)
    events = [
        read_event(r)
        for r in (
            window(10, 0.69),
            ckpt(10, 1, True, 1000, 5.0, "fp32", 0.5),
            window(20, 0.60),
            ckpt(20, 2, False, 300, 1.0, "adaptive4", None, committed=False),
            evaluation(20, 0.70, 0.60),
            {"step": 30, "ckpt_skipped": True},
            {"step": 10, "restored_ckpt": 1, "restore_s": 0.25, "restore_bytes": 1000, "restore_chain": [1]},
        )
    ]
    for e in events:
        log.write(e)
    log.close()
    # Strings (ckpt_error, ckpt_encoding), nulls (a failed checkpoint's ckpt_durable_s) and
    # lists (restore_chain) stay in the JSON file only; bools are 0/1.
    want = {
        "loss": [(10, 0.69), (20, 0.60)],
        "samples_per_s": [(10, 1000.0), (20, 1000.0)],
        "ckpt_id": [(10, 1), (20, 2)],
        "ckpt_committed": [(10, 1), (20, 0)],
        "ckpt_full": [(10, 1), (20, 0)],
        "ckpt_rows": [(10, 100), (20, 30)],
        "ckpt_bytes": [(10, 1000), (20, 300)],
        "ckpt_stall_ms": [(10, 5.0), (20, 1.0)],
        "ckpt_write_s": [(10, 0.01), (20, 0.01)],
        "ckpt_durable_s": [(10, 0.5)],
        "eval_auc": [(20, 0.70)],
        "eval_logloss": [(20, 0.60)],
        "eval_samples": [(20, 1024)],
        "ckpt_skipped": [(30, 1)],
        "ckpt_coalesced": [(30, 0)],
        "restored_ckpt": [(10, 1)],
        "restore_s": [(10, 0.25)],
        "restore_bytes": [(10, 1000)],
    }
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(want)
    for tag, points in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), tag  # stored as float32
    assert [read_event(json.loads(x)) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == events


def test_tensorboard_is_written_by_the_writing_rank_only(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=False, tensorboard_dir=tmp_path / "tensorboard")
    log.write(read_event(window(10, 0.7)))
    log.close()
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_missing_is_a_config_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=r"train\.tensorboard.*pip install 'deltarec\[report\]'"):
        MetricsLog(tmp_path / "metrics.jsonl", enabled=False, tensorboard_dir=tmp_path / "tensorboard")
    MetricsLog(tmp_path / "metrics.jsonl", enabled=True).close()  # off: tensorboard not needed
