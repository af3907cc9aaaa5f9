"""Stage 1 of a checkpoint: which rows changed (tracker), and their copy to host memory during
the stall or beside the next step (snapshot, host_buffers, overlapped_copy)."""
