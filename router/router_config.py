"""The router's configuration: deadlines, caps, failover limits, placement and membership."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.membership import MembershipConfig
from pdserve.router.placement.placement_config import PlacementConfig

UNCAPPED = 1 << 30  # a count no worker reaches


@dataclass(frozen=True)
class RouterConfig:
    """The router's configuration: the model's limits, deadlines, caps, admission, failover limits,
    placement and membership."""
    model_id: str
    max_model_len: int
    vocab_size: int
    prefill_timeout_s: float = 60.0
    decode_start_timeout_s: float = 30.0
    # Silence from a decode worker mid-stream after which the router checks the worker's health
    # (a failed check moves the stream; a busy worker keeps it).
    token_timeout_s: float = 60.0
    control_timeout_s: float = 5.0  # release, abort, stats
    poll_wait_s: float = 0.05
    # At most one poll of a decode worker per this interval (0: the next poll goes out as soon as
    # the last one is answered, at every engine step). A poll costs the router's process the same
    # whatever it carries (a Ray call: docs/benchmarks.md, "Router streaming"), so with many
    # workers stepping every few ms the polls alone can fill its core; a floor makes each carry
    # several steps, at the price of a token waiting up to the floor.
    poll_interval_s: float = 0.0
    max_inflight_per_prefill: int = 256
    # Requests in flight on one decode worker before placement passes it over. By default none: a
    # decode worker batches what its own limit allows and keeps the rest waiting for a place or
    # for KV blocks, so its memory bounds it, and `max_queued_requests` bounds what waits for a
    # first token. A fixed count refused work while the workers' KV memory was largely free.
    max_inflight_per_decode: int = UNCAPPED
    # Requests each pool may hold admitted but without a token yet (router.admission); more are
    # refused at once with RESOURCE_EXHAUSTED and a retry hint. 0: unbounded.
    max_queued_requests: int = 0
    block_size: int = 16  # the workers' KV block size: prompts are hashed exactly as they hash them
    placement: PlacementConfig = PlacementConfig()
    membership: MembershipConfig = MembershipConfig()
    # Failover: a worker that fails a call (dead, unreachable, failing its health check) leaves
    # placement and the request moves on, to at most this many workers of each pool in all.
    max_prefill_attempts: int = 3
    max_decode_attempts: int = 3
    relay_failures_to_fail: int = 3  # failed polls in a row before a decode worker's streams move
    # `--kv-transfer-overlap`: the decode worker pulls a prompt's KV chunk by chunk while it is
    # still being prefilled (`DecodeHandle.prefetch`), so little is left to move after its end.
    kv_transfer_overlap: bool = False
    # On: a special token's text typed in a prompt or message becomes that special token. Off (the
    # default): it is tokenized as text, as `split_special_tokens` does (router/edge/special_tokens.py).
    allow_special_tokens_in_prompt: bool = False
