"""Stage 4: the markers log that makes checkpoints consistent (marker records, the catalog folded
from them, attempt fencing) and the opening of a run's backend (rows stream plus markers log)."""
