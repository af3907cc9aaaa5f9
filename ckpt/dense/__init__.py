"""The dense parameters and data-reader state rank 0 writes beside the rows (capture and store)."""
