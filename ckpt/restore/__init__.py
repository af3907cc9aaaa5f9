"""A restore, in order: choose the checkpoint and its chain (choice), open the readers (the
backend, ckpt/log/backend.py), replay the chain's frames into the shards (replay, staging,
kernel), or assemble a whole model from them (export)."""
