"""Fault scenarios drawn from a seed: a handful of requests, sent through two routers, and one
or two faults at points of those requests, and in about one scenario in ten a router's death
besides. Pure: the same seed gives the same scenario on any machine, so a seed that
breaks an invariant is the whole bug report (`rerun_command`)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

# What each fault does, aimed at one request of the scenario (its victim):
FAULT_KINDS: dict[str, str] = {
    "prefill_dies_before": "the prefill worker dies as the victim's prefill reaches it",
    "prefill_dies_during": "the prefill worker computes the victim's prefill, then dies before answering",
    "prefill_dies_after": "the prefill worker answers, then dies: the decode worker's READ from it fails",
    "decode_dies_before_pull": "the decode worker dies as the victim's KV hand-over reaches it",
    "decode_dies_during_start": "the decode worker pulls the victim's KV, then dies before answering",
    "decode_dies_mid_stream": "the decode worker serving the victim dies after `at` of its tokens",
    "transfer_fails": "the next `count` KV READs of every decode worker fail at once",
    "transfer_dropped": "a KV READ never ends (its deadline passes), under a short prefill lease",
    "transfer_corrupted": "the next `count` KV READs of every decode worker land with a block changed (bit flip or zeros)",
    "client_cancels": "the client cancels the victim after `at` tokens",
    "slow_decode": "one decode worker reads KV slowly and answers its token polls late",
    "router_dies": "the victim's router dies at `point` (as a SIGKILL would): its clients get UNAVAILABLE",
}
ROUTER_DIES = "router_dies"
# Drawn apart from the other kinds, from a generator of its own, so the scenario every other
# seed draws (requests and faults) is the one it drew before routers could die.
DRAWN_KINDS = tuple(k for k in FAULT_KINDS if k != ROUTER_DIES)
ROUTER_DEATH_P = 0.1  # of scenarios that add a router death to their faults
# Where in the victim's life its router dies: as its prefill (or local submit) reaches the
# router's client, once the prefill has answered, once the hand-over (or submit) has answered,
# after `at` of its tokens, or `delay_s` after the scenario starts, wherever the victim is then.
ROUTER_DEATH_POINTS = ("before_prefill", "after_prefill", "after_start", "mid_stream", "timer")
ROUTERS = 2  # request i is sent to router i % ROUTERS
# The prefill workers' lease in a scenario where a router dies: a dead router's prefilled
# request holds its blocks until then (shorter than a server's, so the scenario stays short,
# and still far longer than a hand-over takes).
ROUTER_DEATH_PREFILL_LEASE_S = 3.0
KILLS = {k: k.split("_", 1)[0] for k in FAULT_KINDS if "_dies_" in k}  # kind -> pool whose worker dies
MID_STREAM = ("decode_dies_mid_stream", "client_cancels")
# Not drawn: a known bug, pinned by an xfail test (test_a_token_poll_answered_late_loses_no_token).
LATE_POLL = "late_poll"  # the decode worker's answer to one token poll arrives past the poll's deadline

CI_SCENARIOS = 200  # the default run; PDSERVE_FAULT_SCENARIOS=1000 for the nightly size
NORMAL_DEADLINE_S = 30.0


@dataclass(frozen=True)
class RequestSpec:
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    temperature: float  # 0: greedy
    seed: int | None  # sampled requests are seeded, so their tokens are known in advance
    start_s: float  # when the client sends it, after the scenario starts
    deadline_s: float  # the gRPC deadline the client gives it

    @property
    def tight(self) -> bool:
        """A deadline the request may well miss: ending DEADLINE_EXCEEDED is then correct."""
        return self.deadline_s < NORMAL_DEADLINE_S


@dataclass(frozen=True)
class Fault:
    kind: str
    victim: int  # index of the request it is aimed at
    at: int = 0  # mid-stream kinds: after this many of the victim's tokens
    count: int = 0  # transfer_fails: reads that fail; transfer_dropped: reads that never end
    delay_s: float = 0.0  # slow_decode: seconds added to each READ and each token poll; router_dies at "timer": when
    lease_s: float = 0.0  # transfer_dropped, router_dies: the prefill workers' lease during the scenario
    corruption: str = ""  # transfer_corrupted: "flip" (one bit) or "zero" (the whole block)
    point: str = ""  # router_dies: one of ROUTER_DEATH_POINTS


@dataclass(frozen=True)
class Scenario:
    seed: int
    requests: tuple[RequestSpec, ...]
    faults: tuple[Fault, ...]

    def kills(self, pool: str) -> int:
        return sum(KILLS.get(f.kind) == pool for f in self.faults)

    def dead_routers(self) -> set[int]:
        return {router_of(f.victim) for f in self.faults if f.kind == ROUTER_DIES}

    def on_dead_router(self, i: int) -> bool:
        """Request i was sent to the router that dies: it may end UNAVAILABLE, as a SIGKILL
        leaves it (or with its tokens, if it finished first)."""
        return router_of(i) in self.dead_routers()

    def may_fail(self, i: int, count_router_death: bool = True) -> bool:
        """Whether request i may end with an error status rather than its tokens. Nothing else
        excuses a failure: one dead worker of a pool of two must cost no request.
        `count_router_death=False`: leave out the death of its router (it had ended the request
        before it died)."""
        spec = self.requests[i]
        if spec.tight or (count_router_death and self.on_dead_router(i)):
            return True
        if any(f.kind == "client_cancels" and f.victim == i for f in self.faults):
            return True
        if self.kills("prefill") >= 2 or self.kills("decode") >= 2:
            return True  # a whole pool gone: UNAVAILABLE is the right answer
        # A lease shorter than a transfer's deadline is refused by the decode worker.
        return any(f.kind == "transfer_dropped" for f in self.faults)


def draw(seed: int, vocab_size: int, max_faults: int = 2) -> Scenario:
    rng = random.Random(seed)
    requests: list[RequestSpec] = []
    for i in range(rng.randint(2, 5)):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 48))]
        if requests and rng.random() < 0.4:  # shares a prefix (whole blocks or not) with an earlier one
            base = rng.choice(requests).prompt
            prompt = list(base[: rng.randint(1, len(base))]) + prompt[: rng.randint(0, 16)]
        sampled = rng.random() < 0.25
        tight = rng.random() < 0.1
        requests.append(
            RequestSpec(
                prompt=tuple(prompt),
                max_tokens=rng.randint(4, 16),
                ignore_eos=rng.random() < 0.7,
                temperature=round(rng.uniform(0.5, 1.2), 2) if sampled else 0.0,
                seed=rng.randrange(2**31) if sampled else None,
                start_s=0.0 if i == 0 or rng.random() < 0.5 else round(rng.uniform(0.0, 0.3), 3),
                deadline_s=round(rng.uniform(0.2, 1.5), 2) if tight else NORMAL_DEADLINE_S,
            )
        )
    faults = [_fault(rng, len(requests), requests) for _ in range(1 if rng.random() < 0.7 else max_faults)]
    router = random.Random(f"router-death-{seed}")  # str seeds hash the same on every machine
    if router.random() < ROUTER_DEATH_P:
        faults.append(_router_death(router, requests))
    return Scenario(seed, tuple(requests), tuple(faults))


def router_of(i: int) -> int:
    return i % ROUTERS


def _router_death(rng: random.Random, requests: list[RequestSpec]) -> Fault:
    victim = rng.randrange(len(requests))
    point = rng.choice(ROUTER_DEATH_POINTS)
    return Fault(
        ROUTER_DIES,
        victim,
        at=rng.randint(1, requests[victim].max_tokens - 2) if point == "mid_stream" else 0,
        delay_s=round(rng.uniform(0.0, 0.4), 3) if point == "timer" else 0.0,
        lease_s=ROUTER_DEATH_PREFILL_LEASE_S,
        point=point,
    )


def _fault(rng: random.Random, n: int, requests: list[RequestSpec]) -> Fault:
    kind = rng.choice(DRAWN_KINDS)
    victim = rng.randrange(n)
    if kind in MID_STREAM:
        return Fault(kind, victim, at=rng.randint(1, requests[victim].max_tokens - 2))
    if kind == "transfer_fails":
        return Fault(kind, victim, count=rng.randint(1, 2))
    if kind == "transfer_dropped":
        return Fault(kind, victim, count=1, lease_s=round(rng.uniform(0.3, 1.0), 2))
    if kind == "transfer_corrupted":
        return Fault(kind, victim, count=rng.randint(1, 2), corruption=rng.choice(["flip", "zero"]))
    if kind == "slow_decode":
        return Fault(kind, victim, delay_s=round(rng.uniform(0.05, 0.6), 2))
    return Fault(kind, victim)


def scenario_seeds(env: Mapping[str, str]) -> list[int]:
    """`PDSERVE_FAULT_SEEDS=3,17`: exactly those; else `PDSERVE_FAULT_SCENARIOS` seeds (default
    CI_SCENARIOS) from `PDSERVE_FAULT_FIRST_SEED` (default 0)."""
    if env.get("PDSERVE_FAULT_SEEDS"):
        return [int(s) for s in env["PDSERVE_FAULT_SEEDS"].replace(",", " ").split()]
    first = int(env.get("PDSERVE_FAULT_FIRST_SEED", "0"))
    return list(range(first, first + int(env.get("PDSERVE_FAULT_SCENARIOS", str(CI_SCENARIOS)))))


def rerun_command(seed: int) -> str:
    return f"PDSERVE_FAULT_SEEDS={seed} python -m pytest tests/faults/test_fault_scenarios.py"
