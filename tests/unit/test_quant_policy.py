"""Bit-width policy: expected restores -> bits, fall back after too many restores, optimizer floor."""

from __future__ import annotations

import dataclasses

import pytest

from ckpt.quant import CHECK_N_RUN_WIDTHS, BitWidthPolicy, bits_for_expected_restores, get_codec


@pytest.mark.parametrize("n,bits", [(0, 2), (1, 2), (2, 3), (3, 3), (4, 4), (19, 4), (20, 4), (21, 8), (1000, 8)])
def test_bits_for_expected_restores_with_check_n_runs_table(n, bits):
    assert bits_for_expected_restores(n, CHECK_N_RUN_WIDTHS) == bits


@pytest.mark.parametrize("n,bits", [(0, 4), (1, 4), (2, 8), (3, 8), (20, 8)])
def test_the_default_table_is_4_bit_up_to_1_restore_then_8_bit(n, bits):
    assert bits_for_expected_restores(n) == bits
    assert BitWidthPolicy(expected_restores=n).weight_bits == bits


def test_bits_for_expected_restores_validates():
    with pytest.raises(ValueError):
        bits_for_expected_restores(-1)
    with pytest.raises(TypeError):
        bits_for_expected_restores(2.5)
    with pytest.raises(TypeError):
        bits_for_expected_restores(True)


@pytest.mark.parametrize("n,weight", [(1, "adaptive2"), (3, "adaptive3"), (20, "adaptive4"), (21, "asym8")])
def test_policy_weight_and_optimizer_codecs(n, weight):
    p = BitWidthPolicy(expected_restores=n, widths=CHECK_N_RUN_WIDTHS)
    assert p.weight_codec() == weight
    assert p.optimizer_codec() == "asym8"  # never below 8 bits
    assert p.codecs() == (weight, "asym8")
    get_codec(p.weight_codec())  # names are real codecs


def test_fallback_to_8bit_after_more_restores_than_expected():
    p = BitWidthPolicy(expected_restores=3, widths=CHECK_N_RUN_WIDTHS)
    seen = []
    for _ in range(6):
        seen.append((p.restores_so_far, p.weight_codec(), p.fell_back))
        p = p.after_restore()
    assert seen == [
        (0, "adaptive3", False),
        (1, "adaptive3", False),
        (2, "adaptive3", False),
        (3, "adaptive3", False),  # restored exactly as often as expected: still 3-bit
        (4, "asym8", True),  # one more than expected: 8-bit from now on
        (5, "asym8", True),
    ]
    assert BitWidthPolicy(1, restores_so_far=2).weight_bits == 8
    assert BitWidthPolicy(1, restores_so_far=1, widths=CHECK_N_RUN_WIDTHS).weight_bits == 2
    assert BitWidthPolicy(1, restores_so_far=1).weight_bits == 4


def test_optimizer_floor_configurable():
    assert BitWidthPolicy(1, optimizer_floor_bits=16).optimizer_codec() == "bf16"
    assert BitWidthPolicy(1, optimizer_floor_bits=32).optimizer_codec() == "fp32"
    assert BitWidthPolicy(100, optimizer_floor_bits=8).optimizer_codec() == "asym8"
    # the floor is a rule: optimizer state is never quantized below 8 bits
    for floor in (2, 4, 7, 0):
        with pytest.raises(ValueError, match="never quantized below 8"):
            BitWidthPolicy(1, optimizer_floor_bits=floor)


def test_optimizer_bits_follow_weights_when_weights_are_wider():
    p = BitWidthPolicy(50, optimizer_floor_bits=8)
    assert p.weight_bits == 8 and p.optimizer_bits == 8
    assert BitWidthPolicy(2).optimizer_bits == 8


def test_method_choice():
    assert BitWidthPolicy(1, method="asym", widths=CHECK_N_RUN_WIDTHS).weight_codec() == "asym2"
    assert BitWidthPolicy(3, method="kmeans", widths=CHECK_N_RUN_WIDTHS).weight_codec() == "kmeans3"
    assert BitWidthPolicy(1, method="asym").weight_codec() == "asym4"
    assert BitWidthPolicy(30, method="sym").weight_codec() == "asym8"  # 8-bit is always asym8
    with pytest.raises(ValueError):
        BitWidthPolicy(1, method="int4")


def test_tiny_rows_use_fp32_when_no_larger():
    # row-wise Adagrad keeps one float per row: asym8 would be 9 bytes against fp32's 4
    p = BitWidthPolicy(3, widths=CHECK_N_RUN_WIDTHS)
    assert p.optimizer_codec(dim=1) == "fp32"
    assert p.optimizer_codec(dim=2) == "fp32"  # 10 vs 8 bytes
    assert p.optimizer_codec(dim=3) == "asym8"  # 11 vs 12 bytes
    assert p.weight_codec(dim=1) == "fp32"  # adaptive3: 5 bytes vs 4
    assert p.weight_codec(dim=2) == "adaptive3"  # 5 bytes vs 8
    assert p.weight_codec(dim=64) == "adaptive3"


def test_policy_validates():
    with pytest.raises(ValueError):
        BitWidthPolicy(-1)
    with pytest.raises(ValueError):
        BitWidthPolicy(1, restores_so_far=-1)
    p = BitWidthPolicy(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.restores_so_far = 5  # frozen: use after_restore()


def test_presets_name_deltarecs_default_and_check_n_runs_table():
    from ckpt.quant import DELTAREC_WIDTHS, WIDTH_PRESETS, resolve_widths

    assert CHECK_N_RUN_WIDTHS == ((1, 2), (3, 3), (20, 4))
    assert DELTAREC_WIDTHS == ((1, 4),) == BitWidthPolicy(1).widths
    assert BitWidthPolicy(1).weight_codec() == "adaptive4" and BitWidthPolicy(2).weight_codec() == "asym8"
    assert WIDTH_PRESETS == {"deltarec": DELTAREC_WIDTHS, "check_n_run": CHECK_N_RUN_WIDTHS}
    assert resolve_widths("check_n_run") == CHECK_N_RUN_WIDTHS
    assert resolve_widths([[1, 2], [10, 4]]) == ((1, 2), (10, 4))
    with pytest.raises(ValueError, match="'cnr' is not a preset; choose one of deltarec, check_n_run"):
        resolve_widths("cnr")


@pytest.mark.parametrize("n,weight", [(1, "adaptive4"), (3, "adaptive4"), (4, "asym8"), (50, "asym8")])
def test_a_calibrated_table_replaces_check_n_runs(n, weight):
    """4-bit up to 3 restores, 8-bit beyond; the fallback after more restores than expected still applies."""
    p = BitWidthPolicy(expected_restores=n, widths=[[3, 4]])
    assert p.widths == ((3, 4),)
    assert p.weight_codec() == weight
    assert BitWidthPolicy(expected_restores=1, widths=[[3, 4]], restores_so_far=2).weight_codec() == "asym8"
    assert BitWidthPolicy(expected_restores=1, widths=[]).weight_codec() == "asym8"  # empty table: always 8-bit


@pytest.mark.parametrize("widths,says", [
    ([[3, 8]], r"entry 0: bits must be one of \(2, 3, 4\)"),
    ([[3, 4], [3, 4]], r"entry 1 \[3, 4\]: restores must increase"),
    ([[3, 4], [10, 2]], r"bits must not decrease from entry 0 \[3, 4\]"),
    ([[3]], r"entry 0 must be \[most expected restores, bits\]"),
    ([[3, 2.0]], r"entry 0 must be \[most expected restores, bits\] \(two ints\)"),
])  # fmt: skip
def test_a_table_that_makes_no_sense_is_refused(widths, says):
    from ckpt.quant import check_widths

    with pytest.raises(ValueError, match=says):
        check_widths(widths)
    with pytest.raises(ValueError, match=says):
        BitWidthPolicy(expected_restores=2, widths=widths)
