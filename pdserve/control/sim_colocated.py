"""Discrete-event simulation of a colocated cluster: N workers in role "both", each prefilling
and decoding in mixed steps (`sim_mixed.SimMixed`), requests placed on arrival by the router's
own decode placement (`DecodePolicy`: fewest prompt tokens waiting, then fewest requests in
flight, as the router places in a cluster with no prefill pool). The same traces, performance
models and SLOs as the disaggregated simulator, summarised the same way (`results.summarize`)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.control.perf_model import PerfModel
from pdserve.control.results import RequestTimes, SimResult, summarize
from pdserve.control.signals import Slo
from pdserve.control.sim_mixed import SimMixed
from pdserve.control.trace import SimRequest
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.pool_state import DecodePolicy


@dataclass(frozen=True)
class ColocatedConfig:
    """N colocated workers; a step's token budget (the engine's `max_num_batched_tokens`); the
    host's cores for CPU models (None: each worker owns its device)."""

    workers: int
    slo: Slo = field(default_factory=Slo)
    block_size: int = 16
    step_tokens: int = 2048
    cores: int | None = None
    sample_s: float = 1.0  # timeline resolution
    itl_target_ms: float | None = None  # the workers' `--itl-target-ms` (None: prompt chunks fill the budget)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {self.workers}")
        if self.step_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.step_tokens}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores: must be >= 1, got {self.cores}")
        if self.itl_target_ms is not None and not 0 < self.itl_target_ms < float("inf"):
            raise ValueError(f"itl_target_ms: {self.itl_target_ms}; must be a positive number of milliseconds")


class ColocatedSimulation:
    """Arrivals and step ends as events; every worker steps back to back while it has work."""

    def __init__(
        self,
        reqs: Sequence[SimRequest],
        model: PerfModel,
        cfg: ColocatedConfig,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if cfg.cores is not None and not model.share_slowdown:
            raise ValueError(f"cores: perf model {model.name} has no share_slowdown (its workers own their devices)")
        self.reqs, self.model, self.cfg, self.progress = reqs, model, cfg, progress
        names = [f"w{i}" for i in range(cfg.workers)]
        blocks = model.kv_tokens // cfg.block_size
        target = None if cfg.itl_target_ms is None else cfg.itl_target_ms / 1e3
        self.workers = {n: SimMixed(n, model, blocks, cfg.block_size, cfg.step_tokens, target) for n in names}
        self.policy = DecodePolicy(PlacementConfig(policy="ring"), names, block_size=cfg.block_size)
        self.lengths = {i: (r.input_len, r.output_len, r.hashes) for i, r in enumerate(reqs)}
        self.times = [RequestTimes(r.t) for r in reqs]
        self.placed: dict[int, object] = {}
        self.heap: list = []
        self.seq = itertools.count()
        self.completed = 0
        self.steps = 0  # steps simulated, all workers
        self.timeline: list[dict] = []

    def push(self, t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def stretch(self) -> float:
        """The host model's factor on a step starting now (1 where workers own their devices):
        busy engines and the serving path's CPU for the tokens streamed, per core."""
        if self.cfg.cores is None:
            return 1.0
        m = self.model
        busy = [w for w in self.workers.values() if w.busy or w.has_work]
        tokens_s = sum(w.batch / m.served_step_s(w.batch, w.context) for w in busy if w.batch)
        return m.slowdown((len(busy) + m.background_cores + tokens_s * m.serve_cpu_s_per_token) / self.cfg.cores)

    def arrive(self, i: int, now: float) -> None:
        r = self.reqs[i]
        pl = self.policy.place(r.hashes, r.input_len)
        assert pl is not None  # no capacity bound: the worker's own queue holds what waits
        self.placed[i] = pl
        self.policy.add_prompt(pl.worker, self.own_prompt(i))
        w = self.workers[pl.worker]
        w.waiting.append(i)
        if not w.busy:
            self.start(w, now)

    def own_prompt(self, i: int) -> float:
        """The prompt tokens request i's worker computes: its prompt less the prefix it held."""
        return self.placed[i].uncached_tokens(self.cfg.block_size)

    def start(self, w: SimMixed, now: float) -> None:
        step = w.begin(self.lengths)
        self.push(now + step.seconds * self.stretch(), "step", (w.name, w.version))

    def stepped(self, name: str, version: int, now: float) -> None:
        w = self.workers[name]
        if w.version != version or not w.busy:
            return
        self.steps += 1
        prefilled, done = w.end(self.lengths)
        for i in prefilled:
            self.policy.end_prompt(name, self.own_prompt(i))
            t = self.times[i]
            t.prefilled = now
            # The first token through the worker's relay; the router's costs as measured.
            t.first = now + self.model.request_time_s(self.reqs[i].input_len) * self.stretch()
        for i in done:
            self.finish(i, max(now, self.times[i].first or now))
        if w.has_work:
            self.start(w, now)

    def finish(self, i: int, now: float) -> None:
        self.times[i].done = now
        self.policy.finish(self.placed.pop(i))
        self.completed += 1

    def sample(self, now: float) -> None:
        ws = self.workers.values()
        self.timeline.append(
            {
                "t": round(now, 3),
                "colocated": len(self.workers),
                "decoding": sum(w.batch for w in ws),
                "waiting": sum(len(w.waiting) for w in ws),
            }
        )

    def run(self) -> SimResult:
        for i, r in enumerate(self.reqs):
            self.push(r.t, "arrive", i)
        self.push(self.reqs[0].t, "sample")
        arrived = last_report = 0
        while self.heap:
            now, _, kind, payload = heapq.heappop(self.heap)
            if kind == "arrive":
                self.arrive(payload, now)
                arrived += 1
                if self.progress is not None and arrived - last_report >= 2000:
                    last_report = arrived
                    self.progress(arrived / len(self.reqs))
            elif kind == "step":
                self.stepped(*payload, now)
            elif self.completed < len(self.reqs):  # a sample, while requests remain
                self.sample(now)
                self.push(now + self.cfg.sample_s, "sample")
        return summarize(self.times, self.reqs, self.cfg.slo, (), 0.0, self.timeline, ())


def simulate_colocated(
    reqs: Sequence[SimRequest], model: PerfModel, cfg: ColocatedConfig, progress: Callable[[float], None] | None = None
) -> SimResult:
    """Replay `reqs` on `cfg.workers` colocated workers."""
    return ColocatedSimulation(reqs, model, cfg, progress).run()


def simulate_colocated_with_times(
    reqs: Sequence[SimRequest], model: PerfModel, cfg: ColocatedConfig
) -> tuple[ColocatedSimulation, SimResult]:
    """As `simulate_colocated`, with the simulation kept (its per-request times, step count)."""
    sim = ColocatedSimulation(reqs, model, cfg, None)
    return sim, sim.run()
