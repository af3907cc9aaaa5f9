"""How one training step runs: TorchRec's pipeline (`train.pipeline: sparse_dist`) or one
batch at a time (`plain`).

Both take the next batch from the loop's iterator and return the step's loss and labels.
`TrainPipelineSparseDist` keeps two batches beyond the current one: while step i runs forward
and backward, batch i+1's input all-to-all and batch i+2's host-to-device copy are under way
(on CUDA streams on a GPU). The loop's position and the checkpoint's rows stay exact because
(docs/design/invariants.md, invariant 6):
- positions come from `PositionedBatches`, which counts only trained batches;
- the tracker marks rows in the embedding lookup (`compute_and_output_dist`), which runs in
  step i's forward, never in an input distribution, so batch i+1's ids reach no bitmap before
  step i's checkpoint; no row changes before a step's backward, so the rows a checkpoint copies
  after step i are the rows after step i's update.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol

import torch
from torch.profiler import record_function
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from trainer.data.reader import Batch


class StepResult(NamedTuple):
    loss: torch.Tensor  # detached, on the device
    samples: int  # this rank's samples in the step


class StepRunner(Protocol):
    """Runs one step on the next batch of `batches`."""

    def run(self, batches: Iterator[Batch]) -> StepResult: ...

    def release_model(self) -> None:
        """Give the model back in its plain form before it is used outside the loop
        (evaluation); the next `run` takes it again."""
        ...


class PlainStep:
    """Copy the batch, forward, backward (the fused kernels update embedding rows in place),
    dense update: nothing overlaps."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device

    def run(self, batches: Iterator[Batch]) -> StepResult:
        # labelled like TorchRec's pipeline labels its stages, so one profile reads both loops
        with record_function("## next_batch ##"):
            host_batch = next(batches)
        with record_function("## copy_batch_to_gpu ##"):
            batch = host_batch.to(self.device, non_blocking=True)
        with record_function("## forward ##"):
            loss, _ = self.model(batch)
        with record_function("## zero_grad ##"):
            self.optimizer.zero_grad()
        with record_function("## backward ##"):
            loss.backward()
        with record_function("## optimizer ##"):
            self.optimizer.step()
        return StepResult(loss.detach(), batch.labels.numel())

    def release_model(self) -> None:
        pass


class PipelinedStep:
    """TorchRec's `TrainPipelineSparseDist` over the loop's batches."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.pipeline: TrainPipelineSparseDist = TrainPipelineSparseDist(model, optimizer, device)

    def run(self, batches: Iterator[Batch]) -> StepResult:
        loss, _logits, labels = self.pipeline.progress(batches)
        return StepResult(loss, labels.numel())

    def release_model(self) -> None:
        """`detach` restores the sharded modules' own forwards and keeps the batches in flight;
        `progress` attaches again."""
        self.pipeline.detach()


def make_step(kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> StepRunner:
    """The step runner `train.pipeline` names."""
    return PipelinedStep(model, optimizer, device) if kind == "sparse_dist" else PlainStep(model, optimizer, device)
