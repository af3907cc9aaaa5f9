"""One rank of the writers' exchange test (run by test_exchange): four exchanges on a gloo group
of three ranks, starting from a small capacity: all fitting, one report too large, one decision
too large, all fitting again. Prints ``RESULT <json>``: per exchange the decision this rank got,
the capacity after it and the gathers and broadcasts it took; on rank 0 also how often it decided.

Usage: python -m tests.multirank.exchange_worker RANK WORLD RDZV_FILE
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch.distributed as dist

from ckpt.write.exchange import Exchange

CAPACITY = 256
BIG_REPORT = 5000  # rank 1's report in exchange 1
BIG_DECISION = 20000  # the decision's padding in exchange 2


def main() -> None:
    rank, world, rdzv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    calls = {"gather": 0, "broadcast": 0}
    for name in calls:  # count the collectives each exchange takes
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    exchange: Exchange[dict[str, Any], dict[str, Any]] = Exchange(dist.group.WORLD, capacity=CAPACITY)
    decided = 0
    rounds = []
    for i in range(4):

        def decide(reports: list[dict[str, Any]], i: int = i) -> dict[str, Any]:
            nonlocal decided
            decided += 1
            pad = "d" * (BIG_DECISION if i == 2 else 0)
            return {"round": i, "ranks": [r["rank"] for r in reports], "sizes": [len(r["pad"]) for r in reports], "pad": pad}

        size = BIG_REPORT if (i == 1 and rank == 1) else 10
        before = dict(calls)
        got = exchange({"rank": rank, "pad": "r" * size}, decide if rank == 0 else None)
        rounds.append(
            {
                "round": got["round"],
                "ranks": got["ranks"],
                "sizes": got["sizes"],
                "pad": len(got["pad"]),
                "capacity": exchange.capacity,
                "calls": {k: calls[k] - before[k] for k in calls},
            }
        )
    print("RESULT " + json.dumps({"rank": rank, "rounds": rounds, "decided": decided}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
