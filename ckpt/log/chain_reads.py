"""What replaying a chain reads (docs/design/restore.md): per link, the runs of consecutive frame
index entries a rank wants, each one offset range of one partition.

The restore reads them (ckpt/restore/replay.py). A restarted job reads the same ranges ahead
while it builds its model (ckpt/log/frames_ahead.py), before it knows its shards: it guesses
that it wants what its rank wrote, which under the same sharding plan is exactly what it
wants, so both lists come from `chain_runs` and are equal whenever the guess was right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ckpt.log.markers import ChainLink, IndexEntry, Marker
from ckpt.stream.sink import RangeRead


class ChainRun(NamedTuple):
    """Consecutive wanted index entries of one partition of one link: one range read."""

    link_index: int  # position of `link` in the marker's chain (base first)
    link: ChainLink
    partition: int
    entries: list[IndexEntry]

    def read(self) -> RangeRead:
        return RangeRead(self.link.generation, self.partition, self.entries[0].first, self.entries[-1].last)


def wanted_runs(link: ChainLink, want: Callable[[IndexEntry], bool]) -> list[tuple[int, list[IndexEntry]]]:
    """Per partition, maximal runs of consecutive index entries that `want` accepts."""
    runs: list[tuple[int, list[IndexEntry]]] = []
    previous: dict[int, bool] = {}
    for entry in link.index:
        wanted = want(entry)
        if wanted and previous.get(entry.partition) and runs and runs[-1][0] == entry.partition:
            runs[-1][1].append(entry)
        elif wanted:
            runs.append((entry.partition, [entry]))
        previous[entry.partition] = wanted
    return runs


def chain_runs(marker: Marker, want: Callable[[IndexEntry], bool]) -> list[ChainRun]:
    """Every wanted run of the marker's chain, newest link first (the order a restore issues
    its reads in: a partition's runs are served in offset order whatever the order given)."""
    return [
        ChainRun(i, link, partition, run)
        for i, link in reversed(list(enumerate(marker.chain)))
        for partition, run in wanted_runs(link, want)
    ]


def written_by(rank: int) -> Callable[[IndexEntry], bool]:
    """The entries of frames `rank` wrote (the partition of a frame is its writer's rank, a
    compacted one's too: ckpt/follow/compact.py), which a rank of the same sharding plan wants."""
    return lambda entry: entry.partition == rank
