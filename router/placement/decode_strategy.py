"""The decode placement strategy, behind the same interface as prefill's
(`router.placement.strategies`), and its hook: whether the decode worker chosen for a prompt
prefills it itself (conditional disaggregation)."""

from __future__ import annotations

from typing import Protocol

from pdserve.router.placement.scoring import pick_decode
from pdserve.router.placement.strategies import PlacementRequest, PlacementStrategy, PoolView, ranked_first


class DecodePoolView(PoolView, Protocol):
    """The decode pool as its placement reads it: a pool's view, and per worker the prompt
    tokens it prefills itself that have not reached their first token."""

    prompt_backlog: dict[str, float]


class DecodePlacement(PlacementStrategy):
    """Where a prefilled request decodes: among the workers under the bound on requests in
    flight with KV room, the one that already holds most of its prefix (fewest blocks to pull),
    then the one with the fewest prompt tokens of its own waiting for their first token. Its
    hook `prefill_here` says whether that worker also prefills the prompt."""

    pool: DecodePoolView

    def home(self, key: int | None) -> str | None:
        return None  # the prefix index, not the ring, keeps a prompt near its blocks here

    def place(self, request: PlacementRequest) -> list[str]:
        inflight = {w: self.pool.inflight[w] for w in request.open}
        first = pick_decode(
            request.open, inflight, request.matched, request.headroom, request.needed_blocks,
            c=self.cfg.load_factor, prompt_backlog=self.pool.prompt_backlog,
        )
        return ranked_first(first, request.open)

    def prefill_here(self, num_prompt_tokens: int, matched_tokens: int, has_prefill_workers: bool) -> bool:
        """Whether the decode worker chosen for a prompt prefills it (`prefill_locally`)."""
        limit = self.cfg.max_local_prefill_tokens
        return prefill_locally(num_prompt_tokens, matched_tokens, has_prefill_workers, limit)


def overflow_to_decode(
    least_queued_tokens: float | None, decode_backlog_tokens: float, max_prefill_queue_tokens: int,
    prefill_wait_s: float | None = None, decode_wait_s: float | None = None,
) -> bool:
    """Whether a prompt bound for the prefill pool is prefilled on its decode worker because
    the pool is backed up: every prefill worker below its cap has at least
    `max_prefill_queue_tokens` tokens of prefill in flight (`least_queued_tokens`; None: none is
    below its cap, which `prefill_locally_when_pool_full` decides). Then, once both sides'
    rates are measured, where the prompt would reach its first token sooner (`prefill_wait_s`,
    `decode_wait_s`: its backlog and itself at the rate each side worked off its prompts); until
    then one at a time, while the decode worker has no other such prompt without its first token
    (`decode_backlog_tokens` 0): at a large batch its slack is small, and prompts sent before
    its rate is known would wait there for seconds. 0 turns it off.

    Past one prefill GPU's rate the prefill queue, and with it every request's time to first
    token, grows without bound; the decode workers' spare compute beside their memory-bound
    decode steps takes the excess instead (Dynamo's `max_prefill_queue_size` is the same idea).
    A decode worker keeps its steps within `--itl-target-ms`, so what it takes on depends on its
    batch: the rate it measurably works prompts off, not a fixed bound, says how much.
    """
    if max_prefill_queue_tokens <= 0 or least_queued_tokens is None:
        return False
    if least_queued_tokens < max_prefill_queue_tokens:
        return False
    if prefill_wait_s is not None and decode_wait_s is not None:
        return decode_wait_s < prefill_wait_s
    return decode_backlog_tokens <= 0


def prefill_locally(
    num_prompt_tokens: int, decode_matched_tokens: int, has_prefill_workers: bool, max_local_prefill_tokens: int
) -> bool:
    """Whether to prefill a prompt on the decode worker chosen for it rather than on a prefill worker.

    Always when no prefill worker is in placement (a colocated cluster, or a prefill pool that
    was drained or is down). Otherwise when the tokens the decode worker would have to compute
    (the prompt less the `decode_matched_tokens` its prefix cache holds; at least one, because
    the last prompt token is always computed) are at most `max_local_prefill_tokens`; 0 turns
    local prefill off. A short prompt, or a long one whose prefix the decode worker already
    holds (a multi-turn chat), costs a decode step little more than a transfer would, and saves
    the prefill round trip and the KV hand-over.
    """
    if not has_prefill_workers:
        return True
    if max_local_prefill_tokens <= 0:
        return False
    uncached = max(1, num_prompt_tokens - decode_matched_tokens)
    return uncached <= max_local_prefill_tokens
