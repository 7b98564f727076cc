"""The engine every worker runs: model, paged KV pool, scheduler, sampler."""
