"""Tensor parallelism of the engine: how heads, MLP columns and the vocabulary split across the
ranks of a worker (`tp_layout`), the process group (`tp_group`), each rank's share of the
checkpoint (`sharded_weights`), the step that rank 0 hands to the others (`step_channel`), the
other ranks' loop (`rank_worker`) and rank 0's runner (`tp_runner`)."""
