"""One converter from untyped data (YAML mappings, JSON objects) to typed records.

Config files and overrides become config dataclasses (common/config_loader.py), and
metrics.jsonl records become frozen event dataclasses (ckpt/events.py), through this one
`convert`, so that both accept and refuse the same things the same way: a field's declared
type is the whole check, an unknown or missing key is named with its dotted path, and a bool
never passes as a number. The callers differ in one declared option (`numbers_as_strings`)
and in how they word the error for their user (the file and overrides for a config; the
record's field for a metrics line).

Written here rather than taken from a library: none in deltarec's environment does the job
(pydantic, msgspec, cattrs and dacite are not installed; attrs is, through other packages, and
declares classes without converting untyped data into them), and what both callers need,
unknown keys refused and a wrong type named by its dotted path, is small.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, cast

from common.errors import DeltarecError

Problem = Literal["type", "unknown_key", "missing_key"]
"""What a `TypeMismatch` is about: a value of the wrong type (or not a key name), a key the
dataclass does not have, or a required key that is absent."""


class TypeMismatch(DeltarecError):
    """A value that is not of its declared type, or a mapping whose keys do not fit its
    dataclass. `path` is the dotted path of the value or key ("" for the top level), `problem`
    says which (`Problem`); the message is one line naming the path, what was expected and
    what was got, without the source (file, record), which the caller adds."""

    def __init__(self, path: str, problem: Problem, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class Field:
    """One init field of a dataclass as `convert` reads it: its resolved type, and whether a
    mapping must hold it (a field with a default may be absent)."""

    type: Any
    required: bool


def fields_of(cls: type) -> Mapping[str, Field]:
    """The init fields of dataclass `cls` by name, in declaration order (resolved once per class:
    string annotations under `from __future__ import annotations` are evaluated here)."""
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = _FIELDS[cls] = types.MappingProxyType(
            {
                f.name: Field(hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                for f in dataclasses.fields(cls)
                if f.init
            }
        )
    return fields


_FIELDS: dict[type, Mapping[str, Field]] = {}
"""`fields_of`'s answers by class: a metrics file holds many records of few kinds."""


def convert(tp: Any, value: Any, *, path: str, numbers_as_strings: bool = False) -> Any:
    """`value` as declared type `tp`, or `TypeMismatch` naming the dotted `path` where it is not.

    Supported: dataclasses (from a mapping with string keys; unknown keys refused, required
    fields demanded, nested), `X | Y` and `Optional`, `Literal`, `list[X]`, `tuple[X, ...]`
    (from a list or a tuple: JSON has no tuples), `dict[K, V]`, `Any`, `int`, `float`, `str`,
    `bool`. A bool is never an int or a float; an int passes as a float and becomes one. With
    `numbers_as_strings` a number for a `str` field becomes its string (a YAML `version: 2`
    meant as a name); without it, a `str` field takes only strings. Any other declared type is
    a bug in the declaration: AssertionError."""
    return _convert(tp, value, path, numbers_as_strings)


def _convert(tp: Any, value: Any, path: str, lenient: bool) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, path, lenient)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _union(tp, args, value, path, lenient)
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in args):
            raise TypeMismatch(path, "type", f"{_name(path)} must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    if origin is list:
        (item,) = args or (Any,)
        if not isinstance(value, list):
            raise TypeMismatch(path, "type", f"{_name(path)} must be a list, got {_tname(value)}")
        return [_convert(item, v, _join(path, i), lenient) for i, v in enumerate(value)]
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise AssertionError(f"field {_name(path)} has unsupported type {tp} (of tuples, only tuple[X, ...])")
        if not isinstance(value, (list, tuple)):
            raise TypeMismatch(path, "type", f"{_name(path)} must be a list, got {_tname(value)}")
        return tuple(_convert(args[0], v, _join(path, i), lenient) for i, v in enumerate(value))
    if origin is dict:
        kt, vt = args or (Any, Any)
        if not isinstance(value, dict):
            raise TypeMismatch(path, "type", f"{_name(path)} must be a mapping, got {_tname(value)}")
        return {_convert(kt, k, path, lenient): _convert(vt, v, _join(path, k), lenient) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits: no float holds it
            raise TypeMismatch(path, "type", f"{_name(path)} must be float, got an int too large for one") from None
    if tp is str and lenient and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise TypeMismatch(path, "type", f"{_name(path)} must be {tp.__name__}, got {_tname(value)} {value!r}")
        return value
    raise AssertionError(f"field {_name(path)} has unsupported type {tp}")


def _dataclass(cls: type, data: Any, path: str, lenient: bool) -> Any:
    """Dataclass `cls` from mapping `data`: keys in the data's order, then the first missing one."""
    if not isinstance(data, dict):
        raise TypeMismatch(path, "type", f"{_name(path)} must be a mapping, got {_tname(data)}")
    fields = fields_of(cls)
    for name in data:
        if not isinstance(name, str):  # YAML `1:`, `~:`, `true:`: never a field name
            key = _join(path, name)
            raise TypeMismatch(
                key, "type", f"key {key!r} ({_tname(name)}) is not a name (known keys here: {', '.join(sorted(fields))})"
            )
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = _join(path, unknown[0])
        raise TypeMismatch(key, "unknown_key", f"unknown key {key!r} (known keys here: {', '.join(sorted(fields))})")
    kwargs = {name: _convert(fields[name].type, v, _join(path, name), lenient) for name, v in data.items()}
    missing = [name for name, f in fields.items() if f.required and name not in kwargs]
    if missing:
        key = _join(path, missing[0])
        raise TypeMismatch(key, "missing_key", f"missing required key {key!r}")
    return cast(Any, cls)(**kwargs)


def _union(tp: Any, args: tuple[Any, ...], value: Any, path: str, lenient: bool) -> Any:
    """The first alternative `value` converts to; with one alternative besides None, its error."""
    if value is None and type(None) in args:
        return None
    errors: list[TypeMismatch] = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, path, lenient)
        except TypeMismatch as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    raise TypeMismatch(path, "type", f"{_name(path)}: {value!r} matches none of {tp}")


def _join(path: str, part: object) -> str:
    """The dotted path of `part` (a key or a list index) under `path`."""
    return f"{path}.{part}" if path else str(part)


def _name(path: str) -> str:
    """`path` as messages name it."""
    return path or "top level"


def _tname(value: Any) -> str:
    return "null" if value is None else type(value).__name__
