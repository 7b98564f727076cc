"""Prefill role: batches prompts, pins their KV under a lease and hands out KV handles."""
