"""The writers' meeting for one checkpoint: every rank's report to rank 0, rank 0's outcome back.

One `gather` and one `broadcast` of byte buffers of an agreed capacity, on the writers' own
gloo group. torch's `gather_object` and `broadcast_object_list` take two collectives each (the
sizes, then the data); with a checkpoint every step those rounds are a good part of what a
checkpoint costs the CPU (docs/BENCHMARKS.md, "A checkpoint every step").

A buffer is an int64 length, then that many bytes of pickle, then padding. A rank whose report
does not fit sends only its length; rank 0 then broadcasts a larger capacity instead of an
outcome, and every rank sends again (every rank takes part in every round, so all of them learn
it from the broadcast). An outcome too large for the capacity follows its length in a second
broadcast of its exact size. The capacity only grows, to a power of two, so a run pays the
extra rounds a few times at most. Reports travel with pickle, as they did with `gather_object`:
the writers' group holds only this job's ranks.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch
import torch.distributed as dist

_LENGTH = 8  # bytes of the int64 (little-endian) length in front
#: the capacity a run starts with: a report of a few tables with its loop state fits
INITIAL_CAPACITY = 16 << 10

Report = TypeVar("Report")  # what each rank reports
Decision = TypeVar("Decision")  # what rank 0 decides


@dataclass(frozen=True)
class _Grow:
    """Rank 0's answer when some report did not fit: send again with this capacity."""

    capacity: int


class Exchange(Generic[Report, Decision]):
    """Reports to rank 0, its decision back to every rank, for one group of writers."""

    def __init__(self, group: dist.ProcessGroup, capacity: int = INITIAL_CAPACITY) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.capacity = capacity

    def __call__(self, report: Report, decide: Callable[[list[Report]], Decision] | None) -> Decision:
        """Send `report` to rank 0, which calls `decide` (given on rank 0 only) with every rank's
        report in rank order; returns the decision, on every rank."""
        data = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
        while True:
            gathered = self._gather(data)
            reply: Decision | _Grow | None = None
            if self.rank == 0:
                assert decide is not None and gathered is not None, "rank 0 decides"
                if isinstance(gathered, int):  # some report did not fit: all send again, with room
                    reply = _Grow(_capacity_for(gathered))
                else:
                    reply = decide([pickle.loads(r) for r in gathered])
            answer = self._broadcast(reply)
            if isinstance(answer, _Grow):
                self.capacity = answer.capacity
                continue
            return answer

    def _gather(self, data: bytes) -> list[bytes] | int | None:
        """On rank 0 every rank's bytes, or, when some did not fit, the largest length; None
        elsewhere."""
        buf = _framed(data, self.capacity)
        into = [torch.empty(self.capacity, dtype=torch.uint8) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(buf, into, dst=0, group=self.group)
        if into is None:
            return None
        out = [_unframed(t) for t in into]
        if any(got is None for got, _ in out):
            return max(n for _, n in out)
        return [got for got, _ in out if got is not None]

    def _broadcast(self, reply: Decision | _Grow | None) -> Decision | _Grow:
        """Rank 0's `reply` on every rank."""
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        buf = _framed(data, self.capacity) if self.rank == 0 else torch.empty(self.capacity, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        got, n = _unframed(buf)
        if got is None:  # too large for the capacity: its exact bytes follow
            whole = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
            dist.broadcast(whole, src=0, group=self.group)
            got = whole.numpy().tobytes()
        return pickle.loads(got)


def _framed(data: bytes, capacity: int) -> torch.Tensor:
    """`data` behind its length in a buffer of `capacity` bytes; only the length when it does
    not fit."""
    buf = np.zeros(capacity, dtype=np.uint8)
    buf[:_LENGTH].view("<i8")[0] = len(data)
    if _LENGTH + len(data) <= capacity:
        buf[_LENGTH : _LENGTH + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return torch.from_numpy(buf)


def _unframed(buf: torch.Tensor) -> tuple[bytes | None, int]:
    """(the bytes, their length) of a buffer; (None, length) when they did not fit in it."""
    raw = buf.numpy()
    n = int(raw[:_LENGTH].view("<i8")[0])
    if _LENGTH + n > raw.shape[0]:
        return None, n
    return raw[_LENGTH : _LENGTH + n].tobytes(), n


def _capacity_for(length: int) -> int:
    """The power of two that holds `length` bytes behind their length."""
    return 1 << (_LENGTH + length - 1).bit_length()
