"""Bit width from the expected number of restores (Check-N-Run, sec. 6.2).

Each restore from a quantized checkpoint adds quantization noise to the model, so the fewer
restores a job expects, the fewer bits a checkpoint needs. The table of (most expected restores,
bits) is a parameter (``widths``, config ``ckpt.encoding.restore_bit_widths``: a table or a preset name):

- ``deltarec`` (the default): 4-bit for a job expecting one restore, 8-bit beyond (``((1, 4),)``); how it and
  ``check_n_run`` compare in log loss: docs/BENCHMARKS.md and docs/quant.md;
- ``check_n_run``: Check-N-Run's table from its production jobs (billions of samples): 2-bit for
  at most one restore, 3-bit up to 3, 4-bit up to 20, 8-bit beyond.

Once a job has restored more often than it expected, later checkpoints fall back to 8-bit.
Optimizer-state rows are never quantized below ``optimizer_floor_bits`` (default 8): their
errors compound through every later update. A job calibrates its own table with
bench.quant_accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .registry import get_codec

__all__ = ["bits_for_expected_restores", "check_widths", "resolve_widths", "BitWidthPolicy", "CHECK_N_RUN_WIDTHS",
           "DELTAREC_WIDTHS", "WIDTH_PRESETS", "LOW_BIT_METHODS", "OPTIMIZER_FLOORS"]  # fmt: skip

LOW_BIT_METHODS = ("adaptive", "asym", "sym", "kmeans")
# floor -> codec for optimizer-state rows. 16 is bf16, not fp16: Adagrad accumulators can pass
# fp16's 65504 and underflow its small end; bf16 keeps fp32's exponent range.
OPTIMIZER_FLOORS = {8: "asym8", 16: "bf16", 32: "fp32"}
# (most expected restores, bits) in order; a job expecting more restores than the last entry: 8-bit
Widths = tuple[tuple[int, int], ...]
CHECK_N_RUN_WIDTHS: Widths = ((1, 2), (3, 3), (20, 4))
DELTAREC_WIDTHS: Widths = ((1, 4),)
WIDTH_PRESETS: dict[str, Widths] = {"deltarec": DELTAREC_WIDTHS, "check_n_run": CHECK_N_RUN_WIDTHS}
LOW_BITS = (2, 3, 4)


def codec_for_width(name: str, dim: int) -> str:
    """`name`, or "fp32" for rows of `dim` floats that it would not make smaller: for tiny rows
    (e.g. row-wise Adagrad's one-float momentum) a scale/bias header outweighs the codes,
    and fp32 is lossless besides."""
    return name if get_codec(name).row_bytes(dim) < 4 * dim else "fp32"


def check_widths(widths: Sequence[Sequence[int]]) -> Widths:
    """Validate a restores -> bits table and return it as a tuple of pairs: each entry is
    [most expected restores, bits] with bits in 2..4; restores strictly increasing, and bits never
    fewer for more restores (more restores mean more accumulated noise). An empty table is
    always 8-bit."""
    out, prev = [], (-1, 0)
    for i, pair in enumerate(widths):
        if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in pair):
            raise ValueError(f"entry {i} must be [most expected restores, bits] (two ints), got {list(pair)}")
        n, bits = pair
        if bits not in LOW_BITS:
            raise ValueError(f"entry {i}: bits must be one of {LOW_BITS} (beyond the last entry is 8-bit), got {bits}")
        if n <= prev[0] or bits < prev[1]:
            raise ValueError(
                f"entry {i} {[n, bits]}: restores must increase and bits must not decrease from entry {i - 1} {list(prev)}"
            )
        out.append((n, bits))
        prev = (n, bits)
    return tuple(out)


def resolve_widths(spec: str | Sequence[Sequence[int]]) -> Widths:
    """The table a preset name (`WIDTH_PRESETS`) stands for, or `spec` itself validated."""
    if isinstance(spec, str):
        if spec not in WIDTH_PRESETS:
            raise ValueError(
                f"{spec!r} is not a preset; choose one of {', '.join(WIDTH_PRESETS)} "
                "or give a table [[most expected restores, bits], ...]"
            )
        return WIDTH_PRESETS[spec]
    return check_widths(spec)


def bits_for_expected_restores(n: int, widths: Widths = DELTAREC_WIDTHS) -> int:
    """Bits for a job expecting `n` restores: the first entry of `widths` whose restores >= n,
    else 8 (the default table: 4 for <= 3 expected restores; Check-N-Run's: 2 for <= 1,
    3 for <= 3, 4 for <= 20)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"expected restores must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"expected restores must be >= 0, got {n}")
    return next((bits for most, bits in widths if n <= most), 8)


@dataclass(frozen=True)
class BitWidthPolicy:
    """Which codec to write weights and optimizer-state rows with.

    >>> p = BitWidthPolicy(expected_restores=3)
    >>> p.weight_codec(), p.optimizer_codec()
    ('adaptive4', 'asym8')
    >>> BitWidthPolicy(expected_restores=3, widths=CHECK_N_RUN_WIDTHS).weight_codec()
    'adaptive3'
    >>> p.after_restore().after_restore().after_restore().after_restore().weight_codec()
    'asym8'
    """

    expected_restores: int
    restores_so_far: int = 0
    optimizer_floor_bits: int = 8
    method: str = "adaptive"  # codec family used for 2..4-bit weights
    widths: Widths = DELTAREC_WIDTHS  # (most expected restores, bits); more: 8-bit

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", check_widths(self.widths))
        bits_for_expected_restores(self.expected_restores)  # validates
        if isinstance(self.restores_so_far, bool) or not isinstance(self.restores_so_far, int):
            raise TypeError("restores_so_far must be an int")
        if self.restores_so_far < 0:
            raise ValueError(f"restores_so_far must be >= 0, got {self.restores_so_far}")
        if self.optimizer_floor_bits not in OPTIMIZER_FLOORS:
            raise ValueError(
                f"optimizer_floor_bits must be one of {sorted(OPTIMIZER_FLOORS)} (optimizer-state rows "
                f"are never quantized below 8 bits), got {self.optimizer_floor_bits}"
            )
        if self.method not in LOW_BIT_METHODS:
            raise ValueError(f"method must be one of {LOW_BIT_METHODS}, got {self.method!r}")

    @property
    def fell_back(self) -> bool:
        """True once the job has restored more often than expected: weights go back to 8-bit."""
        return self.restores_so_far > self.expected_restores

    @property
    def weight_bits(self) -> int:
        return 8 if self.fell_back else bits_for_expected_restores(self.expected_restores, self.widths)

    @property
    def optimizer_bits(self) -> int:
        return max(self.weight_bits, self.optimizer_floor_bits)

    def _name(self, bits: int, dim: int | None) -> str:
        name = f"{self.method}{bits}" if bits < 8 else OPTIMIZER_FLOORS[bits]
        return name if dim is None else codec_for_width(name, dim)

    def weight_codec(self, dim: int | None = None) -> str:
        """Codec name for embedding-weight rows (of width ``dim`` when given)."""
        return self._name(self.weight_bits, dim)

    def optimizer_codec(self, dim: int | None = None) -> str:
        """Codec name for optimizer-state rows: never below ``optimizer_floor_bits``."""
        return self._name(self.optimizer_bits, dim)

    def codecs(self, weight_dim: int | None = None, optimizer_dim: int | None = None) -> tuple[str, str]:
        return self.weight_codec(weight_dim), self.optimizer_codec(optimizer_dim)

    def after_restore(self) -> BitWidthPolicy:
        """The policy after one more restore (frozen: returns a new object)."""
        return replace(self, restores_so_far=self.restores_so_far + 1)
