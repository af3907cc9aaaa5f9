"""The converter configs and metrics records share (common/typed.py): every supported type is
accepted and converted, every mismatch is refused with one line naming its dotted path, what was
expected and what was got."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest

from common.errors import DeltarecError
from common.typed import Field, TypeMismatch, convert, fields_of


@dataclass
class Inner:
    count: int
    ratio: float = 0.5
    name: str = "x"


@dataclass
class Outer:
    inner: Inner
    mode: Literal["a", "b"] = "a"
    items: list[int] = field(default_factory=list)
    chain: tuple[int, ...] = ()
    weights: dict[str, float] = field(default_factory=dict)
    limit: int | None = None
    either: int | str = 0
    legacy: Optional[float] = None  # noqa: UP045 (typing.Optional is supported, so it is tested)
    anything: Any = None
    flag: bool = False


@dataclass(frozen=True)
class Frozen:
    step: int
    chain: tuple[int, ...]


def refused(tp: Any, value: Any, path: str = "", **options: bool) -> TypeMismatch:
    with pytest.raises(TypeMismatch) as info:
        convert(tp, value, path=path, **options)
    assert "\n" not in str(info.value)
    return info.value


# --- accepted and converted ----------------------------------------------------------------------


def test_a_nested_dataclass_is_built_with_its_defaults() -> None:
    out = convert(Outer, {"inner": {"count": 3}}, path="")
    assert out == Outer(inner=Inner(count=3))
    assert type(out.inner) is Inner


def test_every_supported_type_is_accepted() -> None:
    data = {
        "inner": {"count": 1, "ratio": 2, "name": "n"},
        "mode": "b",
        "items": [1, 2, 3],
        "chain": [4, 5],
        "weights": {"t": 1, "u": 0.25},
        "limit": 7,
        "either": "seven",
        "legacy": 3,
        "anything": {"free": ["form"]},
        "flag": True,
    }
    out = convert(Outer, data, path="cfg")
    assert out == Outer(
        inner=Inner(count=1, ratio=2.0, name="n"),
        mode="b",
        items=[1, 2, 3],
        chain=(4, 5),
        weights={"t": 1.0, "u": 0.25},
        limit=7,
        either="seven",
        legacy=3.0,
        anything={"free": ["form"]},
        flag=True,
    )
    # an int for a float becomes a float; a JSON list for a tuple becomes a tuple
    assert type(out.inner.ratio) is float and type(out.legacy) is float and type(out.weights["t"]) is float
    assert type(out.chain) is tuple


def test_scalars_convert_on_their_own() -> None:
    assert convert(int, 5, path="n") == 5
    assert convert(float, 5, path="x") == 5.0 and type(convert(float, 5, path="x")) is float
    assert convert(float, 2.5, path="x") == 2.5
    assert convert(str, "s", path="s") == "s"
    assert convert(bool, False, path="b") is False
    assert convert(Any, [1, "a"], path="a") == [1, "a"]


def test_optional_takes_null_and_its_type() -> None:
    assert convert(Optional[int], None, path="o") is None  # noqa: UP045
    assert convert(int | None, None, path="o") is None
    assert convert(int | None, 4, path="o") == 4
    assert convert(float | None, 4, path="o") == 4.0 and type(convert(float | None, 4, path="o")) is float


def test_a_union_takes_the_first_alternative_that_fits() -> None:
    assert convert(int | str, 3, path="u") == 3
    assert convert(int | str, "3", path="u") == "3"
    assert convert(str | list[list[int]], [[20, 4]], path="u") == [[20, 4]]


def test_a_tuple_field_takes_a_list_or_a_tuple() -> None:
    assert convert(tuple[int, ...], [1, 2], path="t") == (1, 2)
    assert convert(tuple[int, ...], (1, 2), path="t") == (1, 2)
    assert convert(tuple[float, ...], [], path="t") == ()
    assert convert(Frozen, {"step": 1, "chain": [3]}, path="") == Frozen(step=1, chain=(3,))


def test_a_dict_converts_keys_and_values() -> None:
    assert convert(dict[str, list[int]], {"a": [1], "b": []}, path="d") == {"a": [1], "b": []}
    assert convert(dict[int, Any], {1: "x"}, path="d") == {1: "x"}


# --- refused, with the path ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "value", "path", "message"),
    [
        (int, "many", "train.steps", "train.steps must be int, got str 'many'"),
        (int, 1.5, "step", "step must be int, got float 1.5"),
        (float, "x", "lr", "lr must be float, got str 'x'"),
        (str, ["a"], "name", "name must be str, got list ['a']"),
        (bool, 3, "flag", "flag must be bool, got int 3"),
        (bool, "true", "flag", "flag must be bool, got str 'true'"),
        (int, None, "n", "n must be int, got null None"),
        (Literal["a", "b"], "c", "mode", "mode must be one of a, b; got 'c'"),
        (list[int], "1,2", "items", "items must be a list, got str"),
        (list[int], (1, 2), "items", "items must be a list, got tuple"),
        (tuple[int, ...], {"a": 1}, "chain", "chain must be a list, got dict"),
        (dict[str, float], [1.0], "weights", "weights must be a mapping, got list"),
        (int | str, [1], "u", "u: [1] matches none of int | str"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_with_its_path(tp: Any, value: Any, path: str, message: str) -> None:
    exc = refused(tp, value, path)
    assert str(exc) == message
    assert (exc.path, exc.problem) == (path, "type")
    assert isinstance(exc, DeltarecError)


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"inner": {"count": 1}, "items": [1, "two"]}, "cfg.items.1", "cfg.items.1 must be int, got str 'two'"),
        ({"inner": {"count": 1}, "chain": [1, 2.5]}, "cfg.chain.1", "cfg.chain.1 must be int, got float 2.5"),
        ({"inner": {"count": 1}, "weights": {"t": "heavy"}}, "cfg.weights.t", "cfg.weights.t must be float, got str 'heavy'"),
        ({"inner": {"count": 1}, "weights": {1: 1.0}}, "cfg.weights", "cfg.weights must be str, got int 1"),
        ({"inner": {"count": "x"}}, "cfg.inner.count", "cfg.inner.count must be int, got str 'x'"),
        ({"inner": [1]}, "cfg.inner", "cfg.inner must be a mapping, got list"),
        ({"inner": {"count": 1}, "limit": "none"}, "cfg.limit", "cfg.limit must be int, got str 'none'"),
        ({"inner": {"count": 1}, "mode": 1}, "cfg.mode", "cfg.mode must be one of a, b; got 1"),
    ],
)
def test_a_nested_mismatch_names_the_dotted_path(data: dict[str, Any], path: str, message: str) -> None:
    exc = refused(Outer, data, "cfg")
    assert (str(exc), exc.path, exc.problem) == (message, path, "type")


def test_the_top_level_must_be_a_mapping() -> None:
    assert str(refused(Outer, ["inner"])) == "top level must be a mapping, got list"
    assert str(refused(Outer, None, "ckpt")) == "ckpt must be a mapping, got null"


def test_an_unknown_key_is_refused_with_the_known_ones() -> None:
    exc = refused(Outer, {"inner": {"count": 1, "cuont": 2}}, "cfg")
    assert str(exc) == "unknown key 'cfg.inner.cuont' (known keys here: count, name, ratio)"
    assert (exc.path, exc.problem) == ("cfg.inner.cuont", "unknown_key")
    assert refused(Inner, {"count": 1, "extra": 0}).path == "extra"  # at the top level: no leading dot


def test_a_missing_required_key_is_named() -> None:
    exc = refused(Outer, {"mode": "a"}, "cfg")
    assert str(exc) == "missing required key 'cfg.inner'"
    assert (exc.path, exc.problem) == ("cfg.inner", "missing_key")
    exc = refused(Outer, {"inner": {}})
    assert (str(exc), exc.path) == ("missing required key 'inner.count'", "inner.count")


def test_a_key_that_is_not_a_string_is_not_a_name() -> None:
    for key, tname in ((1, "int"), (None, "null"), (True, "bool")):
        exc = refused(Inner, {"count": 1, key: 2}, "sec")
        assert str(exc) == f"key 'sec.{key}' ({tname}) is not a name (known keys here: count, name, ratio)"
        assert exc.path == f"sec.{key}"


def test_a_bool_is_never_a_number() -> None:
    assert str(refused(int, True, "n")) == "n must be int, got bool True"
    assert str(refused(float, False, "x")) == "x must be float, got bool False"
    assert str(refused(int | None, True, "n")) == "n must be int, got bool True"
    assert str(refused(Outer, {"inner": {"count": True}})) == "inner.count must be int, got bool True"
    assert str(refused(str, True, "s", numbers_as_strings=True)) == "s must be str, got bool True"


def test_an_int_too_large_for_a_float_is_refused() -> None:
    assert str(refused(float, 10**400, "lr")) == "lr must be float, got an int too large for one"


def test_a_literal_compares_types_too() -> None:
    assert convert(Literal[1, "1"], 1, path="v") == 1
    refused(Literal[1], True, "v")  # True == 1, but a bool is not the literal 1
    refused(Literal["1"], 1, "v")


# --- the option --------------------------------------------------------------------------------


def test_numbers_as_strings_turns_a_number_into_a_string() -> None:
    assert convert(str, 2, path="v", numbers_as_strings=True) == "2"
    assert convert(str, 2.5, path="v", numbers_as_strings=True) == "2.5"
    assert convert(Inner, {"count": 1, "name": 7}, path="", numbers_as_strings=True).name == "7"
    assert convert(str | list[int], 3, path="v", numbers_as_strings=True) == "3"


def test_without_numbers_as_strings_a_number_is_no_string() -> None:
    assert str(refused(str, 2, "v")) == "v must be str, got int 2"
    assert str(refused(str, 2.5, "v", numbers_as_strings=False)) == "v must be str, got float 2.5"
    assert refused(Inner, {"count": 1, "name": 7}).path == "name"
    assert str(refused(str | list[int], 3, "v")) == "v: 3 matches none of str | list[int]"


# --- declarations --------------------------------------------------------------------------------


def test_a_type_it_does_not_know_is_a_bug_in_the_declaration() -> None:
    for tp in (set[int], tuple[int, str], bytes):
        with pytest.raises(AssertionError, match="unsupported type"):
            convert(tp, [1], path="f")


def test_fields_of_says_which_fields_are_required() -> None:
    assert fields_of(Inner) == {"count": Field(int, True), "ratio": Field(float, False), "name": Field(str, False)}
    assert fields_of(Outer)["items"] == Field(list[int], False)
    assert fields_of(Outer) is fields_of(Outer)  # resolved once per class
    with pytest.raises(TypeError):
        fields_of(Inner)["count"] = Field(str, True)  # type: ignore[index]
