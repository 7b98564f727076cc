"""Decode role: imports prompt KV (only the blocks it lacks), decodes in a continuous batch, streams tokens."""
