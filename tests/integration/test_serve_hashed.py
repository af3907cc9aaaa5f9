"""`deltarec-serve` of a job with a hashed table (`managed_collision`): requests carry raw ids,
and every answer is what training's sharded module would give them at the checkpoint served.

The debug job with t_item hashed (raw ids over 2**40 into 200 slots on 2 ranks, evictions every
3 steps) writes a checkpoint every 5 steps to the filesystem sink; the server, a real process,
starts from the chain (a rebuild), follows two more checkpoints as deltas, then a rewind (the
trainer resumes from an older checkpoint) and rebuilds. Each request mixes ids the served
checkpoint holds (on both shards) with ids it does not (which read their shard's miss row).

The reference is independent of the server's slot lookup: the export of the checkpoint
(`deltarec-ckpt export`'s `"mc"` entry, `McTable.lookup`) gives the row of each requested raw
id, and a fresh model scores the request with its hashed table replaced by exactly those rows,
one per id in request order, on one thread as the server runs. Answers must equal it bit for
bit (fp32 rows). Samples come from the test's seed; a failure names the command that replays it.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor

from ckpt.config import load_ckpt_config
from ckpt.restore.export import McTable
from launch.ranks import spawn_ranks, start_command
from tests.integration.test_examples import export_run
from tests.integration.test_hashed_tables import hashed_config
from tests.integration.test_serve import Reference, ServerProc, _catalog, _job, _samples, _serving, _wait_for, predict_as_served
from trainer.config import load_config
from trainer.serve.hashed import HashedTable
from trainer.serve.requests import parse_request
from trainer.serve.servable import Servable
from trainer.serve.versions import serving_module

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, ReplaySeed

pytestmark = pytest.mark.integration

KEY = "model.sparse_arch.managed_collision._embedding_module.embedding_bags.t_item"  # the job's hashed table
MCH = "sparse_arch.managed_collision._managed_collision_collection._managed_collision_modules.t_item"
FEATURE = "f_item"
SPLIT = 2**39  # 2 ranks over 2**40 raw ids: rank 0 holds the ids below


def _in_request_order(features: dict[str, JaggedTensor], *_: Any, **__: Any) -> dict[str, JaggedTensor]:
    """A remap giving each id its position in the request: row i of the table is the i-th id's."""
    return {
        name: JaggedTensor(values=torch.arange(jt.values().numel()), lengths=jt.lengths(), weights=jt.weights_or_none())
        for name, jt in features.items()
    }


def scores_by_raw_id(served: Servable, module: nn.Module, export_file: Path, table: HashedTable, batch: Any) -> torch.Tensor:
    """`batch`'s scores on the export in `export_file`, loaded into `module` (a fresh copy of
    `served`'s), with `table` holding exactly the rows the export's `McTable.lookup` gives the
    batch's raw ids, in request order."""
    exported = torch.load(export_file, weights_only=True)
    state = {k.removeprefix(served.fqn_prefix): v for k, v in exported["model"].items()}
    own = module.state_dict()  # (load_state_dict would have torchrec check the MCH buffers no export fills)
    missing = set(own) - set(state)
    assert set(state) <= set(own) and all("_managed_collision_collection" in k for k in missing), (missing, set(state) - set(own))
    with torch.no_grad():
        for fqn, value in state.items():
            own[fqn].copy_(value)
    (feature,) = table.features
    rows = McTable.from_dict(exported["mc"][table.key]).lookup(batch.sparse[feature].values())
    module.get_submodule(table.key.removeprefix(served.fqn_prefix)).weight.data = rows
    module.get_submodule(table.path).remap = _in_request_order  # type: ignore[assignment]
    return predict_as_served(served, module, batch)


def held_ids(export_file: Path, key: str) -> list[int]:
    """The raw ids the exported checkpoint's table `key` holds."""
    return McTable.from_dict(torch.load(export_file, weights_only=True)["mc"][key]).raw_ids.tolist()


class HashedReference(Reference):
    """Scores of the job's exported checkpoints by raw id (`scores_by_raw_id`)."""

    def of_file(self, path: Path) -> torch.Tensor:
        (table,) = self.served.hashed
        assert (table.key, table.path, table.features) == (KEY, MCH, (FEATURE,)), table
        return scores_by_raw_id(self.served, serving_module(self.job.model), path, table, self.batch)

    def held(self, checkpoint_id: int) -> list[int]:
        self(checkpoint_id)
        return held_ids(self.tmp / f"export-{checkpoint_id}.pt", KEY)


def _body(layout: Any, feature: str, held: list[int], seed: int, split: int, n: int = 24) -> bytes:
    """`n` random samples whose `feature` mixes `held` ids (some from each shard's half of the
    id space, below and above `split`) with random raw ids, which no shard holds."""
    doc = json.loads(_samples(layout, n, seed))
    rng = random.Random(seed)
    low, high = [i for i in held if i < split], [i for i in held if i >= split]
    assert low and high, f"the checkpoint holds ids on one shard only: {len(low)} and {len(high)}"
    for i, sample in enumerate(doc["samples"]):
        pick = [rng.choice(low), rng.choice(high)] if i % 2 else [rng.choice(held)]
        sample["sparse"][feature] = pick + sample["sparse"][feature][:1]  # and a random raw id, mostly
    return json.dumps(doc).encode()


def _answer_matches(server: ServerProc, body: bytes, cfg: Any, checkpoint_id: int, tmp_path: Path) -> None:
    status, doc = server.predict(body)
    assert status == 200 and doc["checkpoint_id"] == checkpoint_id, doc
    tmp_path.mkdir(parents=True, exist_ok=True)
    want = HashedReference(cfg, body, tmp_path)(checkpoint_id)
    got = torch.tensor(doc["scores"], dtype=torch.float32)
    assert torch.equal(got, want), (
        f"the answer of checkpoint {checkpoint_id} differs from training's by raw id (max |diff| {(got - want).abs().max():g})"
    )


def _held(cfg: Any, checkpoint_id: int, tmp_path: Path) -> list[int]:
    where = tmp_path / f"held-{checkpoint_id}"
    where.mkdir(parents=True, exist_ok=True)
    return HashedReference(cfg, _samples(cfg, 1, 0), where).held(checkpoint_id)


def test_hashed_table_is_served_by_raw_id(tmp_path: Path, debug_config: DebugConfig, replay_seed: ReplaySeed) -> None:
    seed = replay_seed.value
    config = hashed_config(debug_config, tmp_path)
    job = _job("servehashed")
    cfg = load_config(config, [*job, f"run.dir={tmp_path / 'run'}"], check_data=False)
    spawn_ranks(config, [*job, "train.steps=20"], tmp_path, timeout_s=180)
    assert max(_catalog(cfg.ckpt).commits) == 4

    server = ServerProc(config, job, tmp_path)
    try:
        # started from the chain: every link's mapping records folded
        _wait_for(_serving(server, 4), 60, "checkpoint 4 served", server)
        assert "rebuilt from 1+2+3+4" in server.text()
        first = _body(cfg, FEATURE, _held(cfg, 4, tmp_path), seed, SPLIT)
        _answer_matches(server, first, cfg, 4, tmp_path / "a")

        # two more checkpoints, applied as deltas to the live mapping; ids held at 4 and evicted since read miss rows
        spawn_ranks(config, [*job, "ckpt.restore.resume=latest", "train.steps=30"], tmp_path, timeout_s=180)
        assert max(_catalog(cfg.ckpt).commits) == 6
        _wait_for(_serving(server, 6), 60, "checkpoint 6 served", server)
        assert "rebuilt from" not in server.text().split("rebuilt from 1+2+3+4", 1)[1]
        _answer_matches(server, first, cfg, 6, tmp_path / "b")
        _answer_matches(server, _body(cfg, FEATURE, _held(cfg, 6, tmp_path), seed + 1, SPLIT), cfg, 6, tmp_path / "c")

        # the trainer resumes from checkpoint 2: the server drops its mapping with the abandoned branch and rebuilds
        spawn_ranks(config, [*job, "ckpt.restore.resume=2", "train.steps=30"], tmp_path, timeout_s=180)
        last = max(_catalog(cfg.ckpt).commits)
        assert last > 6
        _wait_for(_serving(server, last), 60, f"checkpoint {last} of the new branch served", server)
        _answer_matches(server, _body(cfg, FEATURE, _held(cfg, last, tmp_path), seed + 2, SPLIT), cfg, last, tmp_path / "d")
        assert server.call("/healthz")[1]["last_error"] == ""
        assert server.stop() == 0, server.tail()
    finally:
        server.kill()


def test_the_hashed_example_is_served_by_raw_id(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    """examples/hashed_ids.py (a user's own loop, 2 ranks, evictions every 20 steps) served with
    its `served_model` factory: answers by raw user id, as training would at the checkpoint."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "examples/hashed_ids.py", "--run-dir", str(run_dir), "--steps", "40", "--batch-size", "128"]
    argv += ["--init-method", f"file://{tmp_path}/rdzv", "ckpt.schedule.interval_steps=10", "ckpt.encoding.weights=fp32"]
    start_command(argv, tmp_path, world_size=2, timeout_s=180).wait()
    cfg = load_ckpt_config(run_dir / "ckpt.yaml")
    newest = max(_catalog(cfg).commits)
    served = importlib.import_module("examples.hashed_ids").served_model()
    (table,) = served.hashed
    assert table.ids_below == 2**40 and table.features == ("user_id",), table

    export_file = tmp_path / "export.pt"
    export_run(run_dir, export_file)  # the newest checkpoint, as `deltarec-ckpt export` writes it
    body = _body(served.layout(), "user_id", held_ids(export_file, table.key), replay_seed.value, 2**39)
    serve = ["serve.port=0", "serve.poll_s=0.1"]
    server = ServerProc(run_dir / "ckpt.yaml", serve, tmp_path, model="examples.hashed_ids:served_model")
    try:
        _wait_for(_serving(server, newest), 60, f"checkpoint {newest} served", server)
        status, doc = server.predict(body)
        assert status == 200 and doc["checkpoint_id"] == newest, doc
        want = scores_by_raw_id(served, served.fresh_module(), export_file, table, parse_request(body, served.layout(), 1 << 20))
        got = torch.tensor(doc["scores"], dtype=torch.float32)
        assert torch.equal(got, want), f"hashed_ids (seed {replay_seed.value}): max |diff| {(got - want).abs().max():g}"
        assert server.stop() == 0, server.tail()
    finally:
        server.kill()
