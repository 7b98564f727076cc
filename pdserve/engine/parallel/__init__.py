"""Tensor parallelism's processes: the step that rank 0 hands to the other ranks
(`step_channel`), the other ranks' loop (`rank_worker`) and rank 0's runner that starts them
(`tp_runner`). What the model itself needs (each rank's part, the collectives, sliced loading)
is device code under `pdserve.engine.model`."""
