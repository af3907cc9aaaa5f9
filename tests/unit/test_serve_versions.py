"""The served model's two copies (trainer/serve/versions.py): each checkpoint lands whole in the
copy no request reads, the copies stay right through many swaps, and a copy a request still
holds is never written."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ckpt.log.markers import Marker
from ckpt.quant import get_codec
from ckpt.stream.frames import Frame
from ckpt.types import RestoreError
from sharding.config import TableConfig
from sharding.plan import table_key
from trainer.config import ModelConfig
from trainer.model import build_model
from trainer.serve.versions import NotReady, ServedModel

TABLES = {"t_a": (50, 8), "t_b": (30, 8)}


def _cfg() -> ModelConfig:
    tables = [TableConfig(name=n, num_embeddings=r, embedding_dim=d, features=[f"f_{n}"]) for n, (r, d) in TABLES.items()]
    return ModelConfig(dense_in_features=3, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[4, 1], tables=tables)


def _key(table: str) -> str:
    return table_key(table)


class FakeDense:
    """Dense states by checkpoint id, as `DenseStore.read` returns them."""

    def __init__(self, cfg: ModelConfig) -> None:
        model = build_model(cfg, torch.device("cpu"))
        self.names = [n for n, _ in model.named_parameters() if "embedding_bag_collection" not in n]
        self.shapes = {n: p.shape for n, p in model.named_parameters() if n in self.names}
        self.states: dict[str, dict[str, Any]] = {}

    def add(self, checkpoint_id: int, value: float) -> None:
        params = {n: torch.full(self.shapes[n], value) for n in self.names}
        self.states[str(checkpoint_id)] = {"params": params, "buffers": {}, "optimizer": {"state": {}}}

    def read(self, ref: Any) -> dict[str, Any]:
        return self.states[ref.path]


def _marker(checkpoint_id: int) -> Marker:
    return Marker(
        kind="commit",
        run_id="r",
        checkpoint_id=checkpoint_id,
        step=checkpoint_id * 10,
        world_size=1,
        tables={_key(t): [r, d] for t, (r, d) in TABLES.items()},
        dense={"path": str(checkpoint_id), "sha256": "", "bytes": 0},
        step_unix=1000.0 + checkpoint_id,
    )


def _frame(checkpoint_id: int, table: str, ids: torch.Tensor, values: torch.Tensor, col_offset: int = 0) -> Frame:
    fp32 = get_codec("fp32")
    payload = values.contiguous().view(torch.uint8).reshape(len(ids), -1)
    return Frame(
        run_id="r", checkpoint_id=checkpoint_id, rank=0, table=_key(table), col_offset=col_offset, dim=values.shape[1],
        encoding=fp32.code, row_bytes=payload.shape[1], chunk_index=0, chunk_count=1, row_ids=ids, payload=payload,
    )  # fmt: skip


class Trainer:
    """What the stream would hold: the tables after each checkpoint, and its frames."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.tables = {t: torch.randn(r, d, generator=self.gen) for t, (r, d) in TABLES.items()}

    def full(self, cid: int) -> list[Frame]:
        # t_b in two column shards, as column-wise sharding writes it
        b = self.tables["t_b"]
        ids_b = torch.arange(b.shape[0])
        return [
            _frame(cid, "t_a", torch.arange(TABLES["t_a"][0]), self.tables["t_a"]),
            _frame(cid, "t_b", ids_b, b[:, :4].clone(), 0),
            _frame(cid, "t_b", ids_b, b[:, 4:].clone(), 4),
        ]

    def delta(self, cid: int) -> list[Frame]:
        frames = []
        for t, w in self.tables.items():
            ids = torch.randperm(w.shape[0], generator=self.gen)[:7].sort().values
            w[ids] = torch.randn(len(ids), w.shape[1], generator=self.gen)
            frames.append(_frame(cid, t, ids, w[ids].clone()))
        return frames


def _apply(model: ServedModel, dense: FakeDense, cid: int, frames: list[Frame], rebuild: bool) -> None:
    dense.add(cid, float(cid))
    marker = _marker(cid)
    model.begin(marker, rebuild)
    if rebuild:
        model.reset()
    for f in frames:
        model.apply(f, 0, 0)
    if rebuild:
        model.check_complete(cid)
    model.finish(marker)


def _assert_live(model: ServedModel, trainer: Trainer, cid: int) -> None:
    with model.acquire() as v:
        assert v.checkpoint_id == cid and v.step == cid * 10 and v.step_unix == 1000.0 + cid
        for t in TABLES:
            assert torch.equal(v.weights[_key(t)], trainer.tables[t]), f"checkpoint {cid}: table {t}"
        mlp = dict(v.module.named_parameters())["dense_arch.model._mlp.0._linear.weight"]
        assert bool((mlp == float(cid)).all())


def test_each_swap_serves_exactly_the_checkpoint_through_many_deltas_and_a_rebuild() -> None:
    cfg = _cfg()
    dense = FakeDense(cfg)
    model = ServedModel(cfg, dense)  # type: ignore[arg-type]
    trainer = Trainer(seed=1)
    _apply(model, dense, 1, trainer.full(1), rebuild=True)
    _assert_live(model, trainer, 1)
    for cid in range(2, 8):  # each copy in turn catches up with the rows it missed
        _apply(model, dense, cid, trainer.delta(cid), rebuild=False)
        _assert_live(model, trainer, cid)
    # a trainer that restored an older checkpoint: a new chain, rebuilt; then deltas again
    older = Trainer(seed=2)
    _apply(model, dense, 9, older.full(9), rebuild=True)
    _assert_live(model, older, 9)
    for cid in (10, 11, 12):
        _apply(model, dense, cid, older.delta(cid), rebuild=False)
        _assert_live(model, older, cid)


def test_a_copy_a_request_holds_is_never_written_until_it_lets_go() -> None:
    cfg = _cfg()
    dense = FakeDense(cfg)
    model = ServedModel(cfg, dense)  # type: ignore[arg-type]
    trainer = Trainer(seed=3)
    _apply(model, dense, 1, trainer.full(1), rebuild=True)
    _apply(model, dense, 2, trainer.delta(2), rebuild=False)
    held = model.acquire()
    version = held.__enter__()  # a request on checkpoint 2
    before = {k: w.clone() for k, w in version.weights.items()}
    _apply(model, dense, 3, trainer.delta(3), rebuild=False)  # swaps: checkpoint 2's copy is now the standby
    done = threading.Event()
    writer = threading.Thread(target=lambda: (_apply(model, dense, 4, trainer.delta(4), rebuild=False), done.set()))
    writer.start()
    assert not done.wait(0.5), "checkpoint 4 was written into the copy a request still reads"
    assert version.checkpoint_id == 2 and all(torch.equal(version.weights[k], w) for k, w in before.items())
    held.__exit__(None, None, None)
    assert done.wait(30)
    writer.join()
    _assert_live(model, trainer, 4)


def test_a_failed_checkpoint_leaves_the_live_copy_and_the_next_rebuild_is_whole() -> None:
    cfg = _cfg()
    dense = FakeDense(cfg)
    model = ServedModel(cfg, dense)  # type: ignore[arg-type]
    trainer = Trainer(seed=4)
    _apply(model, dense, 1, trainer.full(1), rebuild=True)
    snapshot = {t: w.clone() for t, w in trainer.tables.items()}
    frames = trainer.delta(2)
    dense.add(2, 2.0)
    model.begin(_marker(2), rebuild=False)
    model.apply(frames[0], 0, 0)  # then the stream fails
    model.abandon()
    with model.acquire() as v:
        assert v.checkpoint_id == 1 and all(torch.equal(v.weights[_key(t)], snapshot[t]) for t in TABLES)
    _apply(model, dense, 3, trainer.full(3), rebuild=True)
    _assert_live(model, trainer, 3)
    _apply(model, dense, 4, trainer.delta(4), rebuild=False)  # the other copy, behind by everything, copies all
    _assert_live(model, trainer, 4)


def test_a_base_that_misses_rows_or_columns_is_refused() -> None:
    cfg = _cfg()
    dense = FakeDense(cfg)
    model = ServedModel(cfg, dense)  # type: ignore[arg-type]
    trainer = Trainer(seed=5)
    dense.add(1, 1.0)
    model.begin(_marker(1), rebuild=True)
    model.reset()
    for f in trainer.full(1)[:2]:  # t_b's second column shard is missing
        model.apply(f, 0, 0)
    with pytest.raises(RestoreError, match="t_b is not fully covered"):
        model.check_complete(1)
    model.abandon()
    with pytest.raises(NotReady), model.acquire():  # nothing was ever swapped in
        pass
