"""Initial values of embedding rows as a pure function of (seed, table, row), whatever the plan.

torchrec initialises each shard from the process's random state, so the first value of a
row depends on the world size, the plan and the order shards are built in. deltarec
replaces it with this scheme so that a checkpoint need not store the rows training never
touched: restore regenerates them bit-exactly on any number of ranks (docs/design/formats.md,
"Rows never trained"). The distribution is torchrec's default, uniform in
±sqrt(1 / num_embeddings).

Scheme ``pcg64-chunk-v1``: a table's rows are cut into chunks of `CHUNK_ROWS`; chunk c is
``[rows, dim]`` float32 values ``lo + (hi - lo) * u`` with ``u = (x >> 40) * 2**-24`` for
successive 64-bit outputs ``x`` of numpy's PCG64 seeded with
``SeedSequence([seed, blake2b(table key), c])`` (the key: sharding/shard_views.py). numpy keeps bit generators' streams and
SeedSequence stable across releases, and the float arithmetic is two IEEE float32 ops, so
the values do not depend on the torch or numpy version, the thread count or the device.
Column shards take their columns of the full rows. Optimizer state starts at zero, as
fbgemm's fused optimizers start it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sharding.shard_views import ShardView

SCHEME = "pcg64-chunk-v1"
CHUNK_ROWS = 65536


@dataclass(frozen=True)
class RowInit:
    """How every row of the model-parallel tables was initialised (a marker carries it)."""

    seed: int
    scheme: str = SCHEME

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "seed": self.seed}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> RowInit | None:
        """None for an empty record (a checkpoint that stores every row)."""
        if not d:
            return None
        if d.get("scheme") != SCHEME:
            raise ValueError(f"row initialisation scheme {d.get('scheme')!r} is not known to this deltarec ({SCHEME})")
        return cls(seed=int(d["seed"]))


def bounds(num_embeddings: int) -> tuple[float, float]:
    """torchrec's default init range of a table with `num_embeddings` rows."""
    hi = math.sqrt(1 / num_embeddings)
    return -hi, hi


def _table_key(table: str) -> int:
    return int.from_bytes(hashlib.blake2b(table.encode(), digest_size=16).digest(), "little")


def chunk_values(init: RowInit, table: str, num_embeddings: int, dim: int, chunk: int) -> torch.Tensor:
    """float32 [rows of chunk `chunk`, dim]: the initial values of those rows of `table`."""
    first = chunk * CHUNK_ROWS
    rows = min(CHUNK_ROWS, num_embeddings - first)
    assert rows > 0, (table, chunk, num_embeddings)
    raw = np.random.PCG64(np.random.SeedSequence([init.seed, _table_key(table), chunk])).random_raw(rows * dim)
    u = torch.from_numpy((raw >> np.uint64(40)).astype(np.float32)).view(rows, dim)
    lo, hi = bounds(num_embeddings)
    return u.mul_(2.0**-24).mul_(hi - lo).add_(lo)


def fill_rows(
    init: RowInit,
    table: str,
    num_embeddings: int,
    dim: int,
    dst: torch.Tensor,
    row_offset: int,
    col_offset: int,
    mask: torch.Tensor | None = None,
) -> int:
    """Write the initial values into `dst` ([num_rows, num_cols], rows ``row_offset..``,
    columns ``col_offset..`` of the table), only at the rows `mask` marks (all by default);
    chunks without a marked row are not generated. Returns the rows written."""
    num_rows, num_cols = dst.shape
    written = 0
    for chunk in range(row_offset // CHUNK_ROWS, (row_offset + num_rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        lo = max(chunk * CHUNK_ROWS, row_offset)
        hi = min((chunk + 1) * CHUNK_ROWS, row_offset + num_rows)
        local = slice(lo - row_offset, hi - row_offset)
        picked = None if mask is None else mask[local].nonzero().flatten()
        if picked is not None and not picked.numel():
            continue
        values = chunk_values(init, table, num_embeddings, dim, chunk)
        src = values[lo - chunk * CHUNK_ROWS : hi - chunk * CHUNK_ROWS, col_offset : col_offset + num_cols]
        if picked is None:
            dst[local].copy_(src)
            written += hi - lo
        else:
            dst[local][picked] = src[picked].to(dst.device)
            written += picked.numel()
    return written


@torch.no_grad()
def initialise_shards(
    init: RowInit, shards: Iterable[ShardView], tables: dict[str, tuple[int, int]], masks: dict[int, torch.Tensor] | None = None
) -> int:
    """Set every row of `shards` (or the rows of ``masks[id(shard)]``) to its initial value
    and its optimizer state to zero. `tables`: name -> (num_embeddings, embedding_dim).
    Returns the rows written."""
    written = 0
    for s in shards:
        mask = None if masks is None else masks.get(id(s))
        if mask is not None and not bool(mask.any()):
            continue
        rows, dim = tables[s.table]
        written += fill_rows(init, s.table, rows, dim, s.weight, s.row_offset, s.col_offset, None if mask is None else mask.cpu())
        for state in s.optimizer_states.values():
            if mask is None:
                state.zero_()
            else:
                state[mask.to(state.device)] = 0
    return written
