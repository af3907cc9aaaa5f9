"""`deltarec-serve --model` on runs of a user's own loop: the two examples (examples/), trained
on 2 gloo ranks through `ckpt.Checkpointer`, served from their `ckpt.yaml` with their
`served_model` factories, as real processes over real HTTP.

Every answer tagged checkpoint k equals, bit for bit (fp32 rows), the example's scoring
function on the export of k loaded into its unsharded model: through the server's start from
a chain, the checkpoints a resumed run commits while requests keep coming, and the copy swaps
between them; `deltarec-ckpt export` gives the same model. A feature the model lacks and an
id past its table are one-line 400s.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.config import CkptConfig, load_ckpt_config
from ckpt.dense.store import DenseStore
from ckpt.log.backend import open_backend
from ckpt.restore.export import export
from launch.ranks import start_command
from tests.integration.test_examples import export_run
from tests.integration.test_serve import Load, ServerProc, _catalog, _samples, _serving, _wait_for, predict_as_served
from trainer.serve.requests import parse_request
from trainer.serve.servable import Servable

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

pytestmark = pytest.mark.integration

PLANS = {"two_tower": "table_wise", "sequence_ranking": "row_wise"}
JOB = [
    "ckpt.sink.kind=filesystem",
    "ckpt.schedule.interval_steps=10",
    "ckpt.encoding.weights=fp32",
    "ckpt.encoding.optimizer=fp32",
]


def _train(example: str, run_dir: Path, tmp: Path, steps: int) -> None:
    """The example on 2 gloo ranks up to `steps` (resuming from the run's newest checkpoint)."""
    argv = [sys.executable, f"examples/{example}.py", "--run-dir", str(run_dir), "--steps", str(steps)]
    argv += ["--init-method", f"file://{tmp}/rdzv-{time.monotonic_ns()}", "--plan", PLANS[example], *JOB]
    start_command(argv, tmp, world_size=2, timeout_s=180).wait()


class Reference:
    """The example's scores of one body on exported checkpoints, computed as the server computes them."""

    def __init__(self, served: Servable, cfg: CkptConfig, body: bytes, tmp: Path) -> None:
        self.served, self.cfg, self.tmp = served, cfg, tmp
        self.batch = parse_request(body, served.layout(), 1 << 20)

    def of_file(self, path: Path) -> torch.Tensor:
        module = self.served.fresh_module()
        module.load_state_dict(torch.load(path, weights_only=True)["model"], strict=True)
        return predict_as_served(self.served, module, self.batch)

    def __call__(self, checkpoint_id: int) -> torch.Tensor:
        """The export of `checkpoint_id` (ckpt/restore/export.py, what `deltarec-ckpt export` runs)."""
        catalog = _catalog(self.cfg)
        marker = catalog.cheapest(catalog.commits[checkpoint_id])
        assert marker is not None
        out = self.tmp / f"export-{checkpoint_id}.pt"
        backend = open_backend(self.cfg.run_id, self.cfg.sink, world_size=1)
        try:
            export(marker, backend.source, DenseStore(Path(self.cfg.sink.dense_dir)), self.cfg.run_id, backend.locate, out)
        finally:
            backend.close()
        return self.of_file(out)


@pytest.mark.parametrize("example", sorted(PLANS))
def test_an_own_loop_model_is_served_exactly_as_its_export(tmp_path: Path, example: str, replay_seed: ReplaySeed) -> None:
    run_dir = tmp_path / "run"
    _train(example, run_dir, tmp_path, 20)  # checkpoints 1 and 2
    factory = f"examples.{example}:served_model"
    served: Servable = importlib.import_module(f"examples.{example}").served_model()
    body = _samples(served.layout(), 16, replay_seed.value)
    server = ServerProc(run_dir / "ckpt.yaml", ["serve.port=0", "serve.poll_s=0.1"], tmp_path, model=factory)
    load = None
    try:
        _wait_for(_serving(server, 2), 60, "checkpoint 2 served", server)
        status, doc = server.predict(body)
        assert status == 200 and doc["checkpoint_id"] == 2 and len(doc["scores"]) == 16, doc
        answers = [(2, doc["scores"])]
        feature, rows = served.layout().features[0], served.layout().cardinalities[0]
        for sparse, want in [
            ({"no_such_feature": [1]}, "unknown feature 'no_such_feature'"),
            ({feature: [rows]}, "out of range"),
        ]:
            status, doc = server.predict(json.dumps({"samples": [{"sparse": sparse}]}).encode())
            assert status == 400 and want in doc["error"] and "\n" not in doc["error"], (status, doc)

        load = Load(server, body, threads=1)  # requests throughout the resumed run's checkpoints
        _train(example, run_dir, tmp_path, 40)  # resumes from 2: checkpoints 3 and 4
        _wait_for(_serving(server, 4), 60, "checkpoint 4 served", server)
        _wait_for(lambda: any(cid == 4 for cid, _ in load.answers), 30, "an answer from checkpoint 4", server)
        load.finish()
        assert not load.refused, load.refused[:3]
        answers += load.answers
        assert server.stop() == 0, server.tail()
    finally:
        if load is not None:
            load.finish()
        server.kill()

    cfg = load_ckpt_config(run_dir / "ckpt.yaml")
    reference = Reference(served, cfg, body, tmp_path)
    want = {cid: reference(cid) for cid in sorted({cid for cid, _ in answers})}
    assert set(want) >= {2, 4}, sorted(want)
    for cid, got in answers:
        diff = (torch.tensor(got, dtype=torch.float32) - want[cid]).abs().max().item()
        assert diff == 0.0, (
            f"{example} (seed {replay_seed.value}): an answer tagged checkpoint {cid} differs from its export by {diff:g}"
        )
    # the command users run gives the same model as the in-process export compared with
    export_run(run_dir, tmp_path / "cli-export.pt", 4)
    assert torch.equal(reference.of_file(tmp_path / "cli-export.pt"), want[4])
