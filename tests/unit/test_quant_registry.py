"""Codec lookup, the frozen id table, NaN/Inf refusal and fp16-range refusal."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.quant import (
    CODE_TABLE,
    NonFiniteRowError,
    RowCodec,
    RowRangeError,
    codec_names,
    get_codec,
    register_codec,
)

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

FROZEN = {
    "fp32": 1, "fp16": 2, "bf16": 3,
    "asym2": 18, "asym3": 19, "asym4": 20, "asym8": 24,
    "sym2": 34, "sym3": 35, "sym4": 36, "sym8": 40,
    "adaptive2": 50, "adaptive3": 51, "adaptive4": 52,
    "kmeans2": 66, "kmeans3": 67, "kmeans4": 68,
}  # fmt: skip


def test_code_table_is_frozen():
    # ids are written in frame headers: renumbering would mis-decode every old checkpoint
    assert CODE_TABLE == FROZEN
    assert {n: get_codec(n).code for n in codec_names()} == FROZEN
    assert codec_names() == sorted(FROZEN, key=FROZEN.get)


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_get_codec_by_name_and_code(name):
    c = get_codec(name)
    assert c.name == name
    assert get_codec(FROZEN[name]) is c
    assert 0 < c.code < 256
    assert isinstance(c, RowCodec)


def test_unknown_codec_lists_known_names():
    with pytest.raises(ValueError) as ei:
        get_codec("int4")
    msg = str(ei.value)
    assert "int4" in msg and all(n in msg for n in FROZEN)
    with pytest.raises(ValueError, match="known codecs"):
        get_codec(99)
    with pytest.raises(TypeError):
        get_codec(True)
    with pytest.raises(TypeError):
        get_codec(4.0)


def test_register_refuses_duplicates_and_renumbering():
    class Fake:
        name, code = "asym4", 200

        def row_bytes(self, dim):
            return dim

    with pytest.raises(ValueError):
        register_codec(Fake())  # name taken (and would renumber asym4)
    Fake.name, Fake.code = "brand_new", 20
    with pytest.raises(ValueError):
        register_codec(Fake())  # code taken
    Fake.code = 0
    with pytest.raises(ValueError):
        register_codec(Fake())  # 0 is reserved (uninitialised headers)


@pytest.mark.parametrize("name", sorted(FROZEN))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_rows_refused_naming_table_and_row(name, bad, replay_seed: ReplaySeed):
    x = torch.randn(5, 9, generator=replay_seed.torch_generator())
    x[3, 4] = bad
    ids = torch.tensor([7, 8, 9, 123, 11])
    with pytest.raises(NonFiniteRowError) as ei:
        get_codec(name).encode(x, table="t_user", row_ids=ids)
    e = ei.value
    assert str(e) == "table 't_user' row 123 (global id) has NaN/Inf; refusing to checkpoint it"
    assert isinstance(e, ValueError)
    assert (e.table, e.row, e.index, e.n_bad) == ("t_user", 123, 3, 1)


def test_nonfinite_reports_first_bad_row_and_count():
    x = torch.zeros(6, 4)
    x[2, 0] = float("nan")
    x[5, 3] = float("inf")
    with pytest.raises(NonFiniteRowError) as ei:
        get_codec("asym8").encode(x, table="t", row_ids=torch.arange(100, 106))
    assert ei.value.row == 102 and ei.value.n_bad == 2
    with pytest.raises(NonFiniteRowError, match=r"row 2 \(batch index\)"):
        get_codec("fp32").encode(x)  # no global ids given


def test_huge_finite_rows_are_not_mistaken_for_nonfinite():
    # row sums overflow to inf, but every value is finite: fp32/asym8 must accept them
    x = torch.full((2, 64), 3e37)
    for name in ("fp32", "asym8", "bf16"):
        c = get_codec(name)
        dec = c.decode(c.encode(x), 64)
        assert torch.isfinite(dec).all()


@pytest.mark.parametrize("name", ["fp16", "asym2", "asym3", "asym4", "sym2", "sym3", "sym4", "adaptive2", "adaptive4", "kmeans3"])
def test_rows_beyond_fp16_range_refused(name, replay_seed: ReplaySeed):
    x = torch.randn(4, 8, generator=replay_seed.torch_generator())
    x[2, 1] = 1e6  # fp16 max is 65504: the codec's fp16 value/scale/absmax would be Inf
    with pytest.raises(RowRangeError) as ei:
        get_codec(name).encode(x, table="t_item", row_ids=torch.tensor([40, 41, 42, 43]))
    assert "table 't_item' row 42 (global id)" in str(ei.value) and name in str(ei.value)
    assert ei.value.row == 42 and isinstance(ei.value, ValueError)


def test_fp16_range_limit_is_the_fp16_format_limit():
    # asym N-bit stores fp16 bias and scale: a row [0, 70000] is representable (scale 4667), a row
    # whose min is -70000 is not (bias)
    ok = torch.tensor([[0.0, 70000.0, 1.0, 2.0]])
    dec = get_codec("asym4").decode(get_codec("asym4").encode(ok), 4)
    assert (dec - ok).abs().max() < 70000 / 15
    with pytest.raises(RowRangeError):
        get_codec("asym4").encode(-ok)
    with pytest.raises(RowRangeError):
        get_codec("sym4").encode(ok)  # absmax 70000 > 65504


def test_row_ids_shape_checked():
    with pytest.raises(ValueError, match="row_ids"):
        get_codec("fp32").encode(torch.zeros(3, 2), row_ids=torch.arange(2))
