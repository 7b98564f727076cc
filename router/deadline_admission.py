"""Deadline admission: a request is admitted only if it can start and finish within its deadline
and no request already admitted on its decode worker would then miss its own. Pure: the router
passes the time and the measured figures (`router.deadline_gate` gathers them).

The estimate: the prefill work ahead on its prefill worker and its own, times the measured
prefill time per token, then max_tokens times the measured decode time per token at the
worker's request count with it; the same count slows the others. Nothing measured: no refusal."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.router.admission import MAX_RETRY_MS, MIN_RETRY_MS

# The estimate is a running mean and must fit within this share of the time left: a request's
# own steps vary around it, and its last chunk still has to reach the client.
HEADROOM = 0.8


@dataclass(frozen=True)
class Promise:
    """An admitted request with a deadline on the decode worker, as the rule sees it."""

    deadline: float  # monotonic seconds
    tokens_left: int  # tokens it may still generate


@dataclass(frozen=True)
class Estimate:
    """What was measured of the fleet when a request arrives (None: not measured yet)."""

    prefill_wait_s: float  # until its first token: the prefill work ahead of it and its own
    per_token_now_s: float | None  # decode time per token on its worker without it
    per_token_with_s: float | None  # ... and with it


@dataclass(frozen=True)
class DeadlineRefusal:
    """Why a request was refused on deadline grounds, and when to retry."""

    message: str
    retry_after_ms: int


def _hint(seconds: float) -> int:
    return min(MAX_RETRY_MS, max(MIN_RETRY_MS, math.ceil(seconds * 1000)))


def judge(
    now: float, deadline: float | None, tokens: int, est: Estimate, others: Iterable[Promise]
) -> DeadlineRefusal | None:
    """None to admit a request of up to `tokens` tokens whose deadline is `deadline` (None: it
    has none, and is refused only to keep `others`' deadlines), else why not."""
    with_s = est.per_token_with_s
    if deadline is not None:
        need = est.prefill_wait_s + tokens * (with_s or 0.0)
        left = deadline - now
        if need > HEADROOM * left:
            return DeadlineRefusal(
                f"deadline: the fleet would take about {need:.2f} s for this request ({tokens} tokens) and "
                f"{left:.2f} s are left; retry after {_hint(need - HEADROOM * left)} ms",
                _hint(need - HEADROOM * left),
            )
    now_s = est.per_token_now_s
    if with_s is None or now_s is None or with_s <= now_s:
        return None
    broken = [
        p for p in others
        # One that misses its deadline even without the new request does not hold the others back.
        if p.tokens_left > 0 and p.tokens_left * with_s > HEADROOM * (p.deadline - now)
        and p.tokens_left * now_s <= p.deadline - now
    ]
    if not broken:
        return None
    wait = min(p.tokens_left * now_s for p in broken)  # the first of them ends by then
    return DeadlineRefusal(
        f"deadline: one more request on its decode worker would make {len(broken)} admitted request(s) miss "
        f"their deadline; retry after {_hint(wait)} ms",
        _hint(wait),
    )
