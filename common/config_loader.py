"""Strict loading of nested config dataclasses from YAML and dotted command-line overrides.

Every config section is a plain dataclass; this module reads the YAML, applies the overrides,
and turns the mapping into those dataclasses through common/typed.py's converter (the one that
reads metrics records too), which refuses anything it cannot place: an unknown key is named
with its dotted path and the file it came from, a value of the wrong type names the expected
type.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml

from common.errors import ConfigError
from common.typed import TypeMismatch, convert

T = TypeVar("T")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`; an empty file is an empty mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except UnicodeDecodeError as exc:  # a damaged or binary file: not a traceback either
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}".replace("\n", " ")) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `dotted.key=value` override to the raw mapping, in place.

    The value is parsed as YAML (so `3`, `0.1`, `true`, `[1, 2]` get their types); list
    elements are addressed by index (`model.tables.0.sharding=row_wise`). Type checking
    happens later, when the mapping is turned into dataclasses.
    """
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like dotted.key=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: value is not valid YAML") from exc
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = _step(node, part, ".".join(parts[: i + 1]), create=True)
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(node, last, key)
        node[idx] = value
    elif isinstance(node, dict):
        node[last] = value
    else:  # `train.steps.x=1`: the parent is a value, not a section
        raise ConfigError(f"override key {key!r}: {'.'.join(parts[:-1])!r} is a value, not a mapping")


def _index(node: list[Any], part: str, path: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override key {path!r}: {part!r} is not an index of a {len(node)}-element list")
    return int(part)


def _step(node: Any, part: str, path: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path)]
    if not isinstance(node, dict):
        raise ConfigError(f"override key {path!r}: parent is not a mapping")
    if part not in node and create:
        node[part] = {}
    return node[part]


def build(cls: type[T], data: Any, *, source: str, path: str = "") -> T:
    """Turn a raw mapping into dataclass `cls`, rejecting unknown keys and wrong types.

    The check is common/typed.py's `convert` (shared with metrics records), lenient in one way
    configs need: a YAML number for a `str` field becomes its string. `source` names where the
    data came from (file and overrides) and starts every error message; `path` is the dotted
    key the data sits under (`ckpt` for a checkpoint section), which error messages name.
    """
    try:
        return cast(T, convert(cls, data, path=path, numbers_as_strings=True))
    except TypeMismatch as exc:
        raise ConfigError(f"{source}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-serialisable data (for the resolved config file)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
