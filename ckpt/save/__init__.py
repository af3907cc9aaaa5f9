"""Taking a checkpoint, in the order the training thread does it: `schedule.py` (is one due, and
which kind every rank agrees on), `policy.py` (Check-N-Run's choice of full or delta),
`handoff.py` (the copy to host memory and the hand-off to the writer thread), `outcomes.py`
(what came back: committed, failed, skipped, reported)."""
