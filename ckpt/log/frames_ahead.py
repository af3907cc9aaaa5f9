"""The chain's frames fetched while a restarted job builds its model (docs/design/kafka.md, "Fetching the frames ahead").

Once the markers log is read ahead (ckpt/log/catalog_ahead.py), the checkpoint a restore will
choose is known up to what is appended since, and with it the frames to read. The shards are
not built yet, so each rank guesses the reads it will make: the index entries of the frames
it wrote (`written_by`), which is what it wants when the sharding plan is the one that wrote
them: its rows' entries and, for a managed-collision table, the entry of its shard's mapping
records (``cols`` 0), which the restore reads in the same runs as the rows (under the same
plan a rank's mapping entries are exactly its shards'). `FrameSource.read_ahead`
starts those reads; the restore's own read takes them over when it asks for exactly the same
ranges, and drops them otherwise (another checkpoint chosen, another plan, survivor snapshots
replayed after it).
"""

from __future__ import annotations

from ckpt.log.catalog import Catalog
from ckpt.log.chain_reads import chain_runs, written_by
from ckpt.log.markers import Marker
from ckpt.stream.sink import FrameSource


def checkpoint_to_read(catalog: Catalog, resume: str) -> Marker | None:
    """The checkpoint `ckpt.restore.resume` will most likely restore, from the log read so far: the
    newest restorable one (`latest`), the one named, or None."""
    found = catalog.restorable(abandoned=resume != "latest")
    if resume == "latest":
        return max(found, key=lambda m: m.checkpoint_id, default=None)
    if resume.isdigit():
        return next((m for m in found if m.checkpoint_id == int(resume)), None)
    return None


def read_frames_ahead(marker: Marker, source: FrameSource, rank: int) -> int:
    """Start fetching the frames of `rank`'s partitions of `marker`'s chain (the checkpoint
    `checkpoint_to_read` guessed); returns how many range reads were started."""
    reads = [run.read() for run in chain_runs(marker, written_by(rank))]
    if reads:
        source.read_ahead(reads)
    return len(reads)
