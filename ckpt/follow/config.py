"""The `ckpt.follow` config section: what `deltarec-follow` does for the run it follows."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError


@dataclass
class FollowConfig:
    """When the follower compacts, how it fences, how often it publishes serving snapshots."""

    # compact when the deltas since the newest baseline reach this fraction of its bytes ...
    compact_ratio: float = 0.5
    # ... or when this many deltas follow it (a restore replays at most about this many links)
    compact_links: int = 8
    # a follower that has not renewed its lease for this long may be replaced by another
    lease_s: float = 30.0
    poll_s: float = 1.0  # how often the markers log is read for new COMMITs
    export_every: int = 0  # serving snapshot every N applied checkpoints (0: not by count)
    export_every_s: float = 0.0  # ... or every T seconds (0: not by time)
    export_keep: int = 3  # newest serving snapshots kept
    export_dcp: bool = True  # also a torch.distributed.checkpoint directory beside each file
    export_dir: str = ""  # default <run_dir>/serving
    metrics: str = ""  # default <run_dir>/follower.jsonl

    def validate(self, source: str) -> None:
        if self.compact_ratio <= 0 or self.compact_links < 1:
            raise ConfigError(f"{source}: ckpt.follow.compact_ratio must be > 0 and ckpt.follow.compact_links >= 1")
        if self.poll_s <= 0 or self.lease_s < 3 * self.poll_s:
            raise ConfigError(
                f"{source}: ckpt.follow.poll_s must be > 0 and ckpt.follow.lease_s at least 3 x poll_s "
                f"(the lease is renewed every lease_s / 3), got poll_s={self.poll_s}, lease_s={self.lease_s}"
            )
        if self.export_every < 0 or self.export_every_s < 0 or self.export_keep < 1:
            raise ConfigError(f"{source}: ckpt.follow.export_every / export_every_s must be >= 0 and export_keep >= 1")
