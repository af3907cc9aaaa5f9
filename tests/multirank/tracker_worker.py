"""A rank that checks RowTracker and SnapshotTaker against the live sharded model (run by test_tracker).

It trains through the real `Trainer.train_step` (synthetic reader, DMP model, fused
row-wise Adagrad) and prints one line ``RESULT <json>`` with what it measured:

1. exact: rows whose weights or optimizer state changed over a few steps vs. rows the
   tracker marked, per shard; and how many of the changed rows this rank's own batches
   named (the rest came from other ranks through the all-to-all).
2. eval: an eval-mode forward, `Trainer.evaluate()` and a no-grad training forward mark
   nothing; a training forward marks rows (the positive control).
3. marks: mark_checkpoint / mark_base semantics, since_base ⊇ since_last, counts, state_dict.
4. snapshot: values equal the live rows at take time, global rows, estimate == nbytes,
   unchanged by later training while the live rows moved, full covers every row.
5. hold: `hold_next_lookup`'s two calls in a training step (at the first lookup; before the
   backward pass updates any row, once), and after a no-grad forward (the first during it,
   the second left for the next training step's backward).

Usage: python -m tests.multirank.tracker_worker --config CFG [--column-shards-per-rank K] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ckpt.capture.snapshot import SnapshotTaker
from ckpt.capture.tracker import RowTracker
from common.process import run_main
from sharding.dmp import shard_model
from sharding.process_group import destroy_process_group, detect_env, init_process_group
from sharding.shard_views import ShardMap
from trainer.config import load_config
from trainer.data.factory import make_reader
from trainer.metrics import MetricsLog
from trainer.model import build_model
from trainer.trainer import Trainer


def _state(smap: ShardMap) -> list[list[torch.Tensor]]:
    return [[s.weight.detach().clone(), *(t.detach().clone() for t in s.optimizer_states.values())] for s in smap.shards]


def _changed(before: list[list[torch.Tensor]], smap: ShardMap) -> list[torch.Tensor]:
    """Per shard, bool [num_rows]: weights or any optimizer state differ from `before`."""
    out = []
    for old, s in zip(before, smap.shards):
        new = [s.weight.detach(), *(t.detach() for t in s.optimizer_states.values())]
        diff = torch.zeros(s.num_rows, dtype=torch.bool)
        for a, b in zip(old, new):
            d = a != b
            diff |= d.reshape(s.num_rows, -1).any(dim=1) if d.dim() > 1 else d
        out.append(diff)
    return out


def check_exact(trainer: Trainer, smap: ShardMap, tracker: RowTracker, cfg, steps: int) -> dict:
    feats_of = {t.name: t.features for t in cfg.model.tables}
    own_batches = []
    next_batch = trainer.train_reader.next_batch

    def spy():
        b = next_batch()
        own_batches.append(b)
        return b

    trainer.train_reader.next_batch = spy  # type: ignore[method-assign]
    tracker.mark_base()
    before = _state(smap)
    for _ in range(steps):
        trainer.train_step()
    trainer.train_reader.next_batch = next_batch  # type: ignore[method-assign]
    changed = _changed(before, smap)
    shards = []
    for i, s in enumerate(smap.shards):
        tracked = tracker.since_last(i)
        own = torch.zeros(s.num_rows, dtype=torch.bool)
        for b in own_batches:
            d = b.sparse_features.to_dict()
            for f in feats_of[smap.table_info[s.table].name]:
                mask, local = s.local_rows(d[f].values())
                own[local] = True
        ch = changed[i]
        shards.append(
            {
                "table": smap.table_info[s.table].name,
                "row_offset": s.row_offset,
                "col_offset": s.col_offset,
                "rows": s.num_rows,
                "changed": int(ch.sum()),
                "tracked": int(tracked.sum()),
                "changed_not_tracked": int((ch & ~tracked).sum()),
                "tracked_not_changed": int((tracked & ~ch).sum()),
                "own": int(own.sum()),
                "changed_not_own": int((ch & ~own).sum()),
                "own_not_changed": int((own & ~ch).sum()),
            }
        )
    return {"shards": shards, "replicated": [smap.table_info[t].name for t in smap.replicated_tables]}


def _training_forward(trainer: Trainer, grad: bool) -> None:
    batch = trainer.train_reader.batch_at(10_000 + trainer.env.rank)  # type: ignore[attr-defined]
    trainer.model.train()
    with torch.set_grad_enabled(grad):
        trainer.model(batch)


def check_eval(trainer: Trainer, tracker: RowTracker) -> dict:
    tracker.mark_base()
    trainer.evaluate()
    after_evaluate = tracker.count_since_base()
    batch = trainer.train_reader.batch_at(10_000 + trainer.env.rank)  # type: ignore[attr-defined]
    trainer.model.eval()
    trainer.model(batch)  # grad enabled, eval mode
    after_eval_forward = tracker.count_since_base()
    _training_forward(trainer, grad=False)
    after_no_grad = tracker.count_since_base()
    _training_forward(trainer, grad=True)  # positive control: the same batch, training mode
    after_train_forward = tracker.count_since_base()
    tracker.mark_base()
    return {
        "after_evaluate": after_evaluate,
        "after_eval_forward": after_eval_forward,
        "after_no_grad_forward": after_no_grad,
        "after_train_forward": after_train_forward,
    }


def check_marks(trainer: Trainer, smap: ShardMap, tracker: RowTracker) -> dict:
    n = len(smap.shards)
    tracker.mark_base()
    trained_before = [tracker.trained(i).clone() for i in range(n)]  # what earlier bases folded in
    trainer.train_step()
    first = [tracker.since_last(i) for i in range(n)]
    r: dict = {"first": sum(int(f.sum()) for f in first)}
    r["count_last_ok"] = tracker.count_since_last() == r["first"]
    r["base_eq_last_before_mark"] = all(torch.equal(tracker.since_base(i), first[i]) for i in range(n))
    tracker.mark_checkpoint()
    r["last_after_mark_checkpoint"] = tracker.count_since_last()
    r["base_after_mark_checkpoint_eq_first"] = all(torch.equal(tracker.since_base(i), first[i]) for i in range(n))
    for _ in range(2):
        trainer.train_step()
    second = [tracker.since_last(i) for i in range(n)]
    base = [tracker.since_base(i) for i in range(n)]
    r["second"] = sum(int(s.sum()) for s in second)
    r["second_new_rows"] = sum(int((s & ~f).sum()) for s, f in zip(second, first))
    r["base_eq_union"] = all(torch.equal(b, f | s) for b, f, s in zip(base, first, second))
    r["base_superset_last"] = all(bool((b | ~s).all()) for b, s in zip(base, second))
    r["base_strictly_larger"] = sum(int(b.sum()) for b in base) > r["second"]
    r["count_base_ok"] = tracker.count_since_base() == sum(int(b.sum()) for b in base)
    r["counts_per_shard_ok"] = tracker.counts(True) == [int(b.sum()) for b in base] and tracker.counts(False) == [
        int(s.sum()) for s in second
    ]
    sd = tracker.state_dict()
    tracker.mark_base()
    r["last_after_mark_base"] = tracker.count_since_last()
    r["base_after_mark_base"] = tracker.count_since_base()
    # mark_base folds what it clears into `trained`; a full snapshot then takes exactly those rows
    trained = [t | b for t, b in zip(trained_before, base)]
    r["trained_is_folded_base"] = all(torch.equal(tracker.trained(i), trained[i]) for i in range(n))
    r["trained_counts_ok"] = tracker.counts(False, trained=True) == [int(t.sum()) for t in trained]
    tracker.load_state_dict(sd)
    r["state_dict_roundtrip"] = all(
        torch.equal(tracker.since_last(i), second[i]) and torch.equal(tracker.since_base(i), base[i]) for i in range(n)
    )
    tracker.mark_base()
    return r


def _clone_snapshot(snap) -> list[list[torch.Tensor]]:
    return [[s.global_rows.clone(), s.weights.clone(), *(t.clone() for t in s.optimizer.values())] for s in snap.shards]


def _snapshot_equals_live(snap, smap: ShardMap) -> bool:
    for s, v in zip(snap.shards, smap.shards):
        local = s.global_rows - v.row_offset
        if not torch.equal(s.weights, v.weight.detach()[local]):
            return False
        for k, t in v.optimizer_states.items():
            if not torch.equal(s.optimizer[k], t.detach()[local]):
                return False
    return True


def check_snapshot(trainer: Trainer, smap: ShardMap, tracker: RowTracker) -> dict:
    taker = SnapshotTaker(smap, tracker, trainer.device)
    n = len(smap.shards)
    tracker.mark_base()
    r: dict = {}
    # A full snapshot: every row of every shard.
    est_full = taker.estimate_bytes(full=True, since_base=False)
    full = taker.take(1, trainer.step, full=True, since_base=False)
    r["full_est_eq_nbytes"] = est_full == full.nbytes
    r["full_covers_every_row"] = all(
        torch.equal(s.global_rows, torch.arange(v.row_offset, v.row_offset + v.num_rows))
        for s, v in zip(full.shards, smap.shards)
    )
    r["full_equals_live"] = _snapshot_equals_live(full, smap)
    tracker.mark_base()
    # An incremental snapshot.
    for _ in range(2):
        trainer.train_step()
    est = taker.estimate_bytes(full=False, since_base=False)
    expected_rows = [tracker.since_last(i).nonzero().view(-1) + smap.shards[i].row_offset for i in range(n)]
    snap = taker.take(2, trainer.step, full=False, since_base=False)
    r["delta_rows"] = snap.rows
    r["delta_est"], r["delta_nbytes"] = est, snap.nbytes
    r["delta_global_rows_ok"] = all(torch.equal(s.global_rows, e) for s, e in zip(snap.shards, expected_rows))
    r["delta_meta_ok"] = all(
        (s.table, s.row_offset, s.col_offset) == (v.table, v.row_offset, v.col_offset) for s, v in zip(snap.shards, smap.shards)
    )
    r["delta_equals_live"] = _snapshot_equals_live(snap, smap)
    r["stall_ms"] = snap.stall_s * 1e3
    kept = _clone_snapshot(snap)
    tracker.mark_checkpoint()
    # Training afterwards moves the live rows but not the snapshot.
    for _ in range(2):
        trainer.train_step()
    r["delta_unchanged_after_training"] = all(
        all(torch.equal(a, b) for a, b in zip(k, [s.global_rows, s.weights, *s.optimizer.values()]))
        for k, s in zip(kept, snap.shards)
    )
    r["live_moved_rows"] = sum(
        int((s.weights != v.weight.detach()[s.global_rows - v.row_offset]).any(dim=1).sum())
        for s, v in zip(snap.shards, smap.shards)
    )
    r["full_unchanged_live_differs"] = not _snapshot_equals_live(full, smap)
    # One-shot differential: since_base = rows of both windows.
    est_base = taker.estimate_bytes(full=False, since_base=True)
    expected_base = [tracker.since_base(i).nonzero().view(-1) + smap.shards[i].row_offset for i in range(n)]
    base_snap = taker.take(3, trainer.step, full=False, since_base=True)
    r["base_est_eq_nbytes"] = est_base == base_snap.nbytes
    r["base_rows_ok"] = all(torch.equal(s.global_rows, e) for s, e in zip(base_snap.shards, expected_base))
    r["base_rows"], r["last_rows"] = base_snap.rows, tracker.count_since_last()
    r["base_equals_live"] = _snapshot_equals_live(base_snap, smap)
    tracker.mark_base()
    empty = taker.take(4, trainer.step, full=False, since_base=False)
    r["empty_rows"], r["empty_nbytes"], r["empty_est"] = empty.rows, empty.nbytes, taker.estimate_bytes(False, False)
    return r


def _rows_changed(before: list[list[torch.Tensor]], smap: ShardMap) -> int:
    return int(sum(int(c.sum()) for c in _changed(before, smap)))


def check_hold(trainer: Trainer, smap: ShardMap, tracker: RowTracker) -> dict:
    """What the rows looked like when each of `hold_next_lookup`'s calls ran."""
    events: list[list] = []

    def hold() -> None:
        events.append(["lookup", _rows_changed(before, smap)])

    def before_update() -> None:
        events.append(["before_update", _rows_changed(before, smap)])

    before = _state(smap)
    tracker.hold_next_lookup(hold, before_update)
    trainer.train_step()
    events.append(["step_done", _rows_changed(before, smap)])
    train_events = events[:]
    events.clear()
    before = _state(smap)
    tracker.hold_next_lookup(hold, before_update)
    _training_forward(trainer, grad=False)
    events.append(["forward_done", _rows_changed(before, smap)])
    trainer.train_step()
    events.append(["step_done", _rows_changed(before, smap)])
    tracker.mark_base()
    return {"train_step": train_events, "no_grad_forward_then_step": events}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--column-shards-per-rank", type=int, default=1, help="put k column shards of a table on each rank")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    # The plain loop, reading in this process: the checks call the model directly between steps
    # and spy on the reader. The pipeline's attribution is test_pipeline's.
    cfg = load_config(args.config, ["train.pipeline=plain", "data.workers=0", *args.overrides])
    if args.column_shards_per_rank > 1:
        # Several column shards of one table on one rank: the lookup's KJT then names the
        # same feature at several key positions, one per shard.
        from torchrec.distributed.sharding_plan import column_wise

        import sharding.plan as plan_module

        k = args.column_shards_per_rank
        plan_module.column_wise = lambda ranks: column_wise(ranks=[r for r in ranks for _ in range(k)])
    env = detect_env()
    device = init_process_group(env, init_method=cfg.sharding.init_method)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    sharded = shard_model(build_model(cfg.model, device), cfg.model.tables, cfg.sharding, cfg.optimizer, env, device)
    smap = ShardMap.from_model(sharded.model)
    tracker = RowTracker(smap)
    metrics = MetricsLog(Path(cfg.run.run_dir) / "metrics.jsonl", enabled=False)
    trainer = Trainer(cfg, env, device, sharded, make_reader(cfg, env, "train"), make_reader(cfg, env, "eval"), metrics)
    result = {
        "rank": env.rank,
        "exact": check_exact(trainer, smap, tracker, cfg, args.steps),
        "eval": check_eval(trainer, tracker),
        "marks": check_marks(trainer, smap, tracker),
        "snapshot": check_snapshot(trainer, smap, tracker),
        "hold": check_hold(trainer, smap, tracker),
    }
    print("RESULT " + json.dumps(result), flush=True)
    del trainer, tracker, smap, sharded
    import gc

    gc.collect()
    destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
