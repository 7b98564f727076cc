"""What the controller reads each interval, its SLOs, and the record of what it decided."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def other(self) -> Role:
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 2000.0
    itl_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError("slo: ttft_ms and itl_ms must be > 0")


@dataclass(frozen=True)
class Signals:
    """The cluster as the router and workers see it at `now`. Demand is measured at arrival
    (what came in), never as completions, which back-pressure caps."""

    now: float
    prefill_workers: int  # in placement now
    decode_workers: int
    arriving_prompt_tokens_s: float  # arriving prompt tokens/s the prefix caches will not cover
    arriving_requests_s: float
    arriving_output_tokens_s: float  # tokens/s the arriving requests will decode (their max_tokens)
    queued_prefill_tokens: float  # placed, not yet prefilled
    decode_seqs: int  # sequences decoding or waiting for a decode slot
    decode_context_tokens: float  # their context, all together
    decode_kv_use: float  # 0..1, the mean over decode workers
    # Measured over the last interval (None: no sample). The prefill pool's part of TTFT: from
    # arrival to the prefill's end (a wait for a decode slot is the decode pool's, in decode_seqs).
    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    change_in_flight: bool = False  # a flip is draining, switching or probing, or a worker starting or leaving
    # Workers the cluster holds, in placement or not (mid-flip, starting, unhealthy); None: those
    # in placement. Workers are added up to `ControllerConfig.max_workers`, removed down to its budget.
    total_workers: int | None = None

    @property
    def workers(self) -> int:
        return self.prefill_workers + self.decode_workers

    @property
    def held(self) -> int:
        return self.workers if self.total_workers is None else self.total_workers


@dataclass(frozen=True)
class Decision:
    """One decision, or a non-decision worth recording: the caller logs it, adds it to a span
    and to the metrics (`pdserve_pool_target{role}`, `pdserve_role_changes_total{from,to}`)."""

    t: float
    action: str  # "flip" | "add" | "remove" | "hold"
    reason: str
    prefill: int  # the pools now
    decode: int
    target_prefill: int  # the split the policy would choose from the signals alone
    target_decode: int
    flip_from: Role | None = None  # with action "flip": `count` workers leave this pool for the other
    count: int = 0
    load_prefill: float = 0.0  # predicted utilization (1.0: at the SLO) of each pool now
    load_decode: float = 0.0
    after_prefill: float = 0.0  # ... and after the flip considered
    after_decode: float = 0.0
    close: bool = False  # a hold that nearly was a change (recorded; plain holds are not)
    pool: Role | None = None  # with action "add" / "remove": the pool a worker joins or leaves

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["flip_from"] = None if self.flip_from is None else self.flip_from.value
        d["pool"] = None if self.pool is None else self.pool.value
        return d
