"""Stage 2: the per-rank writer thread that encodes the copied rows into frames and sends them,
and the committer that records each checkpoint's PREPARE/COMMIT once every rank's rows are durable."""
