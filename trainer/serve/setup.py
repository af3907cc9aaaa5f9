"""What one `deltarec-serve` serves, from its command line: the run's checkpoints, the
server's limits and the model.

- ``--config JOB.yaml [key=value ...]``: deltarec-train's job; its DLRM, its `ckpt` and
  `serve` sections.
- ``--config RUN_DIR/ckpt.yaml --model package.module:function [key=value ...]``: a run of a
  user's own loop (the `ckpt.yaml` its Checkpointer wrote) and the factory of its model, a
  function of no arguments returning a `Servable` (trainer/serve/servable.py). `serve.*`
  overrides (and a `serve:` section, if the file has one) set the limits; any other override
  is a `ckpt` key. The factory's module is imported from the working directory first, as
  ``python -m`` would.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckpt.config import CkptConfig, load_ckpt_config
from common.config_loader import apply_override, build, load_yaml
from common.errors import ConfigError, DeltarecError
from trainer.config import JobConfig, ServeConfig, load_config
from trainer.serve.servable import Servable, ServableError
from trainer.serve.versions import dlrm_servable

#: The sections a configuration of a user's own run may have.
OWN_RUN_SECTIONS = {"ckpt", "serve"}


@dataclass(frozen=True)
class Serving:
    """The run whose checkpoints are served (`ckpt`), the server's settings and the model."""

    ckpt: CkptConfig
    serve: ServeConfig
    model: Servable
    metrics_path: Path  # the server's JSON-lines log

    @classmethod
    def of_job(cls, job: JobConfig) -> Serving:
        """deltarec-train's job: its DLRM."""
        if not job.ckpt.enabled:
            raise DeltarecError(f"{job.source}: ckpt.enabled is false: this job writes no checkpoints to serve")
        metrics = Path(job.serve.metrics) if job.serve.metrics else job.run.run_dir / "serve.jsonl"
        return cls(job.ckpt, job.serve, dlrm_servable(job.model), metrics)


def load_serving(config: str | Path, overrides: list[str], model: str | None = None) -> Serving:
    """What `deltarec-serve --config CONFIG [--model MODEL] [key=value ...]` serves (the module doc)."""
    sections = load_yaml(config)
    own_run = isinstance(sections, dict) and "ckpt" in sections and set(sections) <= OWN_RUN_SECTIONS
    if model is None:
        if own_run:
            raise ConfigError(f"{config} is the ckpt.yaml of a run of your own loop: name its model with --model module:function")
        return Serving.of_job(load_config(config, overrides, check_data=False))
    if not own_run:
        raise ConfigError(f"--model serves a run of your own loop: --config is its <run_dir>/ckpt.yaml, not {config}")
    serve_overrides = [o.removeprefix("serve.") for o in overrides if o.startswith("serve.")]
    ckpt_overrides = [o.removeprefix("ckpt.") for o in overrides if not o.startswith("serve.")]
    ckpt = load_ckpt_config(config, ckpt_overrides)
    if not ckpt.enabled:
        raise DeltarecError(f"{config}: ckpt.enabled is false: this run writes no checkpoints to serve")
    serve_data = dict(sections.get("serve") or {})
    for override in serve_overrides:
        apply_override(serve_data, override)
    source = f"{config}{' with overrides' if overrides else ''}"
    serve = build(ServeConfig, serve_data, source=source, path="serve")
    serve.validate(source)
    metrics = Path(serve.metrics) if serve.metrics else Path(config).absolute().parent / "serve.jsonl"
    return Serving(ckpt, serve, load_factory(model)(), metrics)


def load_factory(spec: str) -> Callable[[], Servable]:
    """The function `package.module:function` names (imported from the working directory
    first), wrapped to check it returns a `Servable`."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--model {spec}: expected package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"--model {spec}: cannot import {module_name}: {exc}") from None
    factory: object = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"--model {spec}: {module_name} has no {attr}")
    if not callable(factory):
        raise ConfigError(f"--model {spec}: {attr} is not callable")

    def make() -> Servable:
        served = factory()  # type: ignore[operator]
        if not isinstance(served, Servable):
            raise ServableError(f"--model {spec} returned a {type(served).__name__}, not a trainer.serve.servable.Servable")
        return served

    return make
