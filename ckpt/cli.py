"""`deltarec-ckpt`: inspect and manage a run's checkpoints.

    deltarec-ckpt --config CONFIG [key=value ...] list
    deltarec-ckpt --config CONFIG [key=value ...] verify [--checkpoint N]
    deltarec-ckpt --config CONFIG [key=value ...] export --out model.pt [--dcp DIR] [--checkpoint N]
    deltarec-ckpt --config CONFIG [key=value ...] gc --keep N

The job's own config names the backend (Kafka or filesystem), the run id and the dense
store, so the same overrides that ran the job find its checkpoints. Loading that config is
the trainer layer's job: the console script is `trainer.ckpt_cli`, which hands this module
the resolved `ckpt` section.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

from ckpt.backends import open_backend
from ckpt.config import CkptConfig
from ckpt.dense_store import DenseRef, DenseStore
from ckpt.export import export
from ckpt.markers import Marker, MarkerError, decode_marker, select
from ckpt.restore import RestoreError, iter_chain_frames
from common.errors import DeltarecError

logger = logging.getLogger(__name__)


class CliError(DeltarecError):
    """A command-line argument that cannot be used."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltarec-ckpt", description="Inspect and manage deltarec checkpoints.")
    p.add_argument("--config", required=True, help="the job's YAML config")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="the job's overrides")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="checkpoints with step, kind, bytes, ranks, status")
    v = sub.add_parser("verify", help="re-read and check every frame of a checkpoint")
    v.add_argument("--checkpoint", type=int, help="default: the newest committed")
    e = sub.add_parser("export", help="write the full unsharded model")
    e.add_argument("--out", type=Path, required=True, help="torch.save file")
    e.add_argument("--dcp", type=Path, help="also a torch.distributed.checkpoint directory")
    e.add_argument("--checkpoint", type=int, help="default: the newest committed")
    g = sub.add_parser("gc", help="drop generations older than the newest N restorable checkpoints")
    g.add_argument("--keep", type=int, required=True)
    # Overrides may come after the subcommand too (argparse stops at the subcommand).
    args, extra = p.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = [*args.overrides, *extra]
    return args


def _markers(backend, run_id: str) -> list[Marker]:
    out = []
    for pos, data in backend.markers.read_markers():
        try:
            m = decode_marker(data)
        except MarkerError as exc:
            raise MarkerError(f"{backend.where} markers position {pos}: {exc}") from exc
        if m.run_id == run_id:
            out.append(m)
    return out


def _choose(markers: list[Marker], checkpoint: int | None) -> Marker:
    found = select([(None, m) for m in markers if m.kind == "commit"], checkpoint)
    if found is None:
        raise RestoreError("no committed checkpoint" + (f" with id {checkpoint}" if checkpoint is not None else ""))
    return found


def cmd_list(markers: list[Marker], dense: DenseStore) -> int:
    print(f"{'id':>5} {'step':>8} {'kind':<6} {'bytes':>12} {'chain':>12} {'ranks':>5}  status")
    for m in sorted(markers, key=lambda m: m.checkpoint_id):
        if m.kind == "failed":
            print(f"{m.checkpoint_id:>5} {m.step:>8} {'-':<6} {'-':>12} {'-':>12} {m.world_size:>5}  failed: {m.error}")
            continue
        status = "complete" if Path(m.dense.get("path", "")).is_file() else "dropped (gc)"
        kind = "full" if m.full else "delta"
        print(f"{m.checkpoint_id:>5} {m.step:>8} {kind:<6} {m.bytes:>12,} {m.chain_bytes:>12,} {m.world_size:>5}  {status}")
    return 0


def cmd_verify(marker: Marker, backend, dense: DenseStore, run_id: str) -> int:
    frames = rows = 0
    for _, frame in iter_chain_frames(marker, backend.source, run_id, backend.locate):
        frames += 1
        rows += frame.row_count
    dense.read(DenseRef.from_json(marker.dense))
    print(f"checkpoint {marker.checkpoint_id} (step {marker.step}): OK, {frames} frames, {rows} rows, dense sha256 matches")
    return 0


def cmd_gc(markers: list[Marker], keep: int, backend, dense: DenseStore) -> int:
    if keep < 1:
        raise CliError("--keep must be at least 1: gc never drops the newest checkpoint")
    commits = sorted((m for m in markers if m.kind == "commit" and Path(m.dense.get("path", "")).is_file()),
                     key=lambda m: m.checkpoint_id)
    kept = commits[-keep:]
    needed = {link.generation for m in kept for link in m.chain}
    all_generations = {link.generation for m in markers if m.kind == "commit" for link in m.chain}
    dropped = sorted(g for g in all_generations if g < min(needed, default=0))
    for g in dropped:
        backend.sink.drop_generation(g)
    kept_ids = {m.checkpoint_id for m in kept}
    dense.delete([m.checkpoint_id for m in commits if m.checkpoint_id not in kept_ids])
    print(f"kept checkpoints {sorted(kept_ids)}; dropped generations {dropped}")
    return 0


def main(argv: Sequence[str], load_ckpt_config: Callable[[str, list[str]], CkptConfig]) -> int:
    """Run one command; `load_ckpt_config(path, overrides)` gives the job's resolved `ckpt` section."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        cfg = load_ckpt_config(args.config, args.overrides)
        run_id = cfg.run_id
        backend = open_backend(cfg, world_size=1)
        dense = DenseStore(Path(cfg.dense_dir))
        try:
            markers = _markers(backend, run_id)
            if args.command == "list":
                return cmd_list(markers, dense)
            if args.command == "gc":
                return cmd_gc(markers, args.keep, backend, dense)
            marker = _choose(markers, args.checkpoint)
            if args.command == "verify":
                return cmd_verify(marker, backend, dense, run_id)
            model = export(marker, backend.source, dense, run_id, backend.locate, args.out, args.dcp)
            print(f"exported checkpoint {marker.checkpoint_id} (step {marker.step}, {len(model['tables'])} tables) to {args.out}"
                  + (f" and {args.dcp}" if args.dcp else ""))
            return 0
        finally:
            backend.close()
    except DeltarecError as exc:
        print(f"deltarec-ckpt: error: {exc}", file=sys.stderr)
        return 1
