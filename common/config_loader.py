"""Strict loading of nested config dataclasses from YAML and dotted command-line overrides.

Every config section is a plain dataclass; this module turns untyped YAML mappings into
those dataclasses and refuses anything it cannot place: an unknown key is named with its
dotted path and the file it came from, a value of the wrong type names the expected type.
Written here rather than taken from a library because none of the small YAML-to-dataclass
packages on the machine both reject unknown keys and type-check dotted overrides.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

import yaml

from common.errors import ConfigError

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

    `source` names where the data came from (file and overrides) for error messages.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {path or 'top level'} must be a mapping, got {_tname(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls)) if f.init}
    for name in data:
        if not isinstance(name, str):  # YAML `1:`, `~:`, `true:`: never a config key
            key = f"{path}.{name}" if path else str(name)
            raise ConfigError(
                f"{source}: key {key!r} ({_tname(name)}) is not a name (known keys here: {', '.join(sorted(fields))})"
            )
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"{source}: unknown key {key!r} (known keys here: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, source=source, path=f"{path}.{name}" if path else name)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        key = f"{path}.{missing[0]}" if path else missing[0]
        raise ConfigError(f"{source}: missing required key {key!r}")
    return cls(**kwargs)


def _convert(tp: Any, value: Any, *, source: str, path: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(cast(type, tp), value, source=source, path=path)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, source=source, path=path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{source}: {path}: {value!r} matches none of {tp}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{source}: {path} must be one of {', '.join(map(str, allowed))}; got {value!r}")
        return value
    if origin in (list, list):
        (item,) = get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {path} must be a list, got {_tname(value)}")
        return [_convert(item, v, source=source, path=f"{path}.{i}") for i, v in enumerate(value)]
    if origin in (dict, dict):
        kt, vt = get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {path} must be a mapping, got {_tname(value)}")
        return {
            _convert(kt, k, source=source, path=path): _convert(vt, v, source=source, path=f"{path}.{k}")
            for k, v in value.items()
        }
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{source}: {path} must be {tp.__name__}, got {_tname(value)} {value!r}")
        return value
    raise AssertionError(f"config field {path} has unsupported type {tp}")


def _tname(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-serialisable data (for the resolved config file)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
