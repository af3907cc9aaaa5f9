"""The training loop: a Stateful `Trainer` that steps, evaluates and reports.

The trainer owns the loop state (step, samples seen, reader position, RNG); parameters
and optimizer state belong to the sharded model. `state_dict()` / `load_state_dict()`
give a checkpointer everything it needs to resume the loop exactly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch

from ckpt.events import Evaluation, TrainWindow
from sharding.dmp import ShardedModel
from sharding.process_group import DistEnv
from trainer.config import JobConfig
from trainer.data.loader import PositionedBatches, positioned_batches
from trainer.data.reader import Reader
from trainer.metrics import MetricsLog, Progress
from trainer.step import StepRunner, make_step

logger = logging.getLogger(__name__)


class Checkpointer(Protocol):
    """What the loop needs from a checkpointer: a call after every step, and for each logged
    window the steps a crash after each of its steps would have lost (mean, most; None: not
    known)."""

    def save(self, step: int) -> None: ...

    def steps_at_risk(self) -> tuple[float, int] | None: ...


class StopRequested(Exception):
    """The launcher asked this rank to stop (SIGTERM: under torchrun, another rank failed).
    Raised between steps, so the loop state is that of a completed step."""


@dataclass
class EvalResult:
    auc: float
    logloss: float
    samples: int


class Trainer(Stateful):
    """Runs `train.steps` steps of DLRM on this rank's slice of the data."""

    def __init__(
        self,
        cfg: JobConfig,
        env: DistEnv,
        device: torch.device,
        sharded: ShardedModel,
        train_reader: Reader,
        eval_reader: Reader | None,
        metrics: MetricsLog,
    ) -> None:
        self.cfg = cfg
        self.env = env
        self.device = device
        self.model = sharded.model
        assert sharded.optimizer is not None, "deltarec's loop steps the combined optimizer shard_model builds"
        self.optimizer = sharded.optimizer
        self.train_reader = train_reader
        self.eval_reader = eval_reader
        # Every evaluation reads the same held-out batches, so numbers compare over time.
        self._eval_start = eval_reader.state_dict() if eval_reader is not None else None
        self.metrics = metrics
        self.step = 0
        self.samples_seen = 0
        self.last_eval: EvalResult | None = None
        self.checkpointer: Checkpointer | None = None
        self.stop_requested = False  # set by a signal handler (trainer/stop.py); checked between steps
        self.keep_step_start = False  # partial recovery: remember the RNG before each step
        self._rng_at_step_start: torch.Tensor | None = None  # RNG before the step in progress
        self._batches: PositionedBatches | None = None  # started by the first step
        self._step: StepRunner | None = None

    # -- Stateful -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Loop position: step, samples, this rank's reader state after the last trained batch
        (batches read ahead are not counted) and RNG state."""
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "reader": self._trained_position(),
            "rng_torch": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self._drop_batches()
        self.train_reader.load_state_dict(state["reader"])
        torch.set_rng_state(state["rng_torch"])

    def completed_state(self) -> dict[str, Any]:
        """`state_dict()` as of the last completed step, also while a step is in progress (a
        collective failed inside it): what a surviving rank saves (ckpt/recovery/survivor.py).
        The reader position counts trained batches only, so only the RNG needs remembering."""
        state = self.state_dict()
        if self._rng_at_step_start is not None:
            state["rng_torch"] = self._rng_at_step_start
        return state

    def skip_batches(self, n: int) -> None:
        """Move the reader past `n` batches without training on them (partial recovery: the
        batches a rank that died would have trained since the checkpoint)."""
        self._drop_batches()
        for _ in range(n):
            self.train_reader.next_batch()

    # -- batches --------------------------------------------------------------------
    def _trained_position(self) -> dict:
        return self._batches.trained if self._batches is not None else self.train_reader.state_dict()

    def _drop_batches(self) -> None:
        """Forget the batches read ahead: the reader goes back to the last trained batch, and the
        next step starts a new loader (and pipeline) from there."""
        if self._batches is None:
            return
        position = self._batches.trained
        self._batches.close()
        self._batches = None
        if self._step is not None:
            self._step.release_model()
            self._step = None
        self.train_reader.load_state_dict(position)

    def _started(self) -> tuple[PositionedBatches, StepRunner]:
        if self._batches is None or self._step is None:
            d = self.cfg.data
            self._batches = positioned_batches(self.train_reader, d.workers, d.prefetch_batches, self.device)
            self._step = make_step(self.cfg.train.pipeline, self.model, self.optimizer, self.device)
        return self._batches, self._step

    def close(self) -> None:
        """Stop the loader's workers and hand the model back in its plain form."""
        self._drop_batches()

    # -- loop -----------------------------------------------------------------------
    def train_step(self) -> torch.Tensor:
        """One step through `train.pipeline`'s step runner (trainer/step.py)."""
        self.model.train()
        if self.keep_step_start:  # only `completed_state` needs it; other jobs pay nothing per step
            self._rng_at_step_start = torch.get_rng_state()
        batches, runner = self._started()
        result = runner.run(batches)
        batches.trained_one()
        self.step += 1
        self.samples_seen += result.samples * self.env.world_size
        self._rng_at_step_start = None
        return result.loss

    def fit(self) -> EvalResult | None:
        """Train to `train.steps`, evaluating every `train.eval_every` steps and at the end."""
        tc = self.cfg.train
        progress = Progress(tc.steps, self.step, tc.progress, enabled=self.env.rank == 0)
        window_loss = torch.zeros((), dtype=torch.float64, device=self.device)  # summed where the loss is
        window_steps, window_t0 = 0, time.perf_counter()
        try:
            while self.step < tc.steps:
                window_loss += self.train_step().double()
                window_steps += 1
                if self.checkpointer is not None:
                    self.checkpointer.save(self.step)
                if self.stop_requested:
                    raise StopRequested(f"stop requested after step {self.step}")
                progress.advance(self.step)
                if self.step % tc.log_every == 0 or self.step == tc.steps:
                    rate = window_steps * self.cfg.data.batch_size * self.env.world_size / (time.perf_counter() - window_t0)
                    loss = self._global_mean(window_loss / window_steps)
                    risk = self.checkpointer.steps_at_risk() if self.checkpointer is not None else None
                    mean, most = risk if risk is not None else (None, None)
                    self.metrics.write(
                        TrainWindow(
                            step=self.step, loss=loss, samples_per_s=rate, steps_at_risk_mean=mean, steps_at_risk_max=most
                        )
                    )
                    progress.update(self.step, {"loss": loss, "samples/s": rate})
                    window_loss.zero_()
                    window_steps, window_t0 = 0, time.perf_counter()
                if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.steps:
                    self._evaluate_and_log()
        finally:
            progress.close()
            if self._batches is not None:  # an error ending the loop leaves no worker behind (PositionedBatches.close)
                self._batches.close()
        self.close()
        return self._evaluate_and_log()

    def _global_mean(self, value: torch.Tensor) -> float:
        t = value.detach().to(torch.float64).reshape(1)
        dist.all_reduce(t)
        return float(t.item() / self.env.world_size)

    def _evaluate_and_log(self) -> EvalResult | None:
        result = self.evaluate()
        if result is not None:
            self.metrics.write(
                Evaluation(step=self.step, eval_auc=result.auc, eval_logloss=result.logloss, eval_samples=result.samples)
            )
            if self.env.rank == 0:
                logger.info("eval at step %d: AUC %.4f, log loss %.4f", self.step, result.auc, result.logloss)
        self.last_eval = result
        return result

    @torch.no_grad()
    def evaluate(self) -> EvalResult | None:
        """AUC and log loss over `train.eval_batches` held-out batches of every rank."""
        if self.eval_reader is None or self.cfg.train.eval_batches == 0:
            return None
        assert self._eval_start is not None
        if self._step is not None:
            self._step.release_model()
        self.eval_reader.load_state_dict(self._eval_start)
        auroc = BinaryAUROC().to(self.device)
        logloss = MeanMetric().to(self.device)
        self.model.eval()
        for _ in range(self.cfg.train.eval_batches):
            batch: Batch = self.eval_reader.next_batch().to(self.device)
            _, (_, logits, labels) = self.model(batch)
            logits = logits.reshape(-1).float()
            labels = labels.reshape(-1).float()
            auroc.update(torch.sigmoid(logits), labels.long())
            per_sample = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
            logloss.update(per_sample)
        samples = self.cfg.train.eval_batches * self.cfg.data.batch_size * self.env.world_size
        # compute() gathers every rank's predictions (torchmetrics syncs over the default group).
        return EvalResult(float(auroc.compute()), float(logloss.compute()), samples)
