"""Where a request goes: each pool's placement state (ring, prefix index, loads; `pool_state`),
the strategies that rank its workers (`strategies`), and their configuration. No I/O."""
