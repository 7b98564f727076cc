"""Discrete-event simulator of a disaggregated cluster: the router's own placement objects
(`router.placement.pool_state.PrefillPolicy`, `DecodePolicy`) place every request, simulated workers
(`sim_workers`) take their times from a `PerfModel`, and with a controller the very policy
the live cluster will run (`pdserve.control.controller.Controller`) decides the split, through
`sim_actuator.SimActuator`, which drains, flips and rejoins workers as the flip protocol does.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.control.capacity import CapacityModel
from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.perf_model import PerfModel
from pdserve.control.results import RequestTimes, SimResult, summarize
from pdserve.control.signals import Decision, Signals, Slo
from pdserve.control.sim_actuator import SimActuator
from pdserve.control.sim_workers import SimDecode, SimPrefill
from pdserve.control.trace import SimRequest
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.pool_state import DecodePolicy, PrefillPolicy


@dataclass(frozen=True)
class SimConfig:
    workers: int
    prefill: int | None = None  # a static split; None: the controller decides (starting at `start_prefill`)
    start_prefill: int | None = None  # None: half the workers
    slo: Slo = field(default_factory=Slo)
    block_size: int = 16
    drain_deadline_s: float = 5.0  # decode streams still running then move to other decode workers
    sample_s: float = 1.0  # timeline resolution in a static run
    window_s: float = 10.0  # arrival rates and latency percentiles over this window (at least an interval)
    # A prefill worker's token budget per step: the engine's max_num_batched_tokens (its default;
    # pdserve.control may not import the engine's arguments).
    prefill_step_tokens: int = 2048
    # Host cores the workers and the router share (the model's share_slowdown stretches steps when
    # more are busy than there are cores); None: every worker owns its device.
    cores: int | None = None
    # With the controller: workers it may add (each after the model's start_s) up to this many, and
    # remove down to `workers` (None: `workers`, a fixed budget).
    max_workers: int | None = None
    # The pools' tensor-parallel widths, for the controller: with different widths no worker flips.
    # The perf model given is already the pools' (`tp_model.pool_pair`).
    prefill_width: int = 1
    decode_width: int = 1

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError("workers: a disaggregated cluster needs >= 2")
        if self.prefill is not None and not 1 <= self.prefill <= self.workers - 1:
            raise ValueError(f"prefill: must be 1..{self.workers - 1}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores: must be >= 1, got {self.cores}")
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ValueError(f"max_workers: {self.max_workers} is below workers ({self.workers}); it must be >= them")


class Simulation:
    def __init__(self, reqs: Sequence[SimRequest], model: PerfModel, cfg: SimConfig,
                 progress: Callable[[float], None] | None) -> None:
        self.reqs, self.model, self.cfg, self.progress = reqs, model, cfg, progress
        if cfg.cores is not None and not model.share_slowdown:
            raise ValueError(f"cores: perf model {model.name} has no share_slowdown (its workers own their devices)")
        self.stretch = 1.0  # the host model's factor now (1 without one)
        self.heap: list = []
        self.seq = itertools.count()
        p = cfg.prefill if cfg.prefill is not None else (cfg.start_prefill or cfg.workers // 2)
        names = [f"w{i}" for i in range(cfg.workers)]
        self.cache_blocks = model.kv_tokens // cfg.block_size
        self.prefill = {n: self.new_prefill(n) for n in names[:p]}
        self.decode = {n: SimDecode(n, model, 0.0) for n in names[p:]}
        pcfg = PlacementConfig(policy="ring")  # no KV events in the simulation: the ring keeps prefixes home
        self.pp = PrefillPolicy(pcfg, list(self.prefill), block_size=cfg.block_size)
        self.dp = DecodePolicy(pcfg, list(self.decode), block_size=cfg.block_size)
        self.times = [RequestTimes(r.t) for r in reqs]
        self.placed: dict[int, object] = {}
        self.uncached: dict[int, int] = {}
        self.waiting: deque[tuple[int, int, float]] = deque()  # (request, context, tokens left) for a decode slot
        self.act = SimActuator(self, first_name=cfg.workers)
        self.arrivals: deque[tuple[float, int, int, int]] = deque()  # (t, uncached, prompt, output) in the window
        self.recent: deque[tuple[float, float, float | None]] = deque()  # (t, ttft, itl) finished
        self.timeline: list[dict] = []
        self.decisions: list[Decision] = []
        self.capacity = CapacityModel(model)
        self.ctrl = None
        if cfg.prefill is None:
            ccfg = ControllerConfig(workers=cfg.workers, slo=cfg.slo, max_workers=cfg.max_workers,
                                    prefill_width=cfg.prefill_width, decode_width=cfg.decode_width)
            self.ctrl = Controller(ccfg, flip_s=model.flip_s, start_s=model.start_s)

    def new_prefill(self, name: str) -> SimPrefill:
        return SimPrefill(name, self.model, self.cache_blocks, self.cfg.block_size, self.cfg.prefill_step_tokens)

    def push(self, t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    # ----- prefill ------------------------------------------------------------------------

    def arrive(self, i: int, now: float) -> None:
        r = self.reqs[i]
        pl = self.pp.place(r.hashes, r.input_len, now)
        assert pl is not None
        w = self.prefill[pl.worker]
        unc = r.input_len - w.hit_tokens(r.hashes, r.input_len)
        self.placed[i], self.uncached[i] = pl, unc
        self.arrivals.append((now, unc, r.input_len, r.output_len))
        w.queue.append(i)
        w.queued_tokens += unc
        if not w.busy:
            self.start_prefill(w, now)

    def start_prefill(self, w: SimPrefill, now: float) -> None:
        uncached, tokens = {}, 0
        for i in w.queue:  # the prompts this step can reach: a budget's worth of uncached tokens
            if tokens >= w.budget:
                break
            if i in w.todo:
                total, before = w.todo[i]
                tokens += total - before
                continue
            r = self.reqs[i]
            uncached[i] = r.input_len - w.hit_tokens(r.hashes, r.input_len)  # the cache may have changed
            tokens += uncached[i]
        w.busy = True
        chunks, dt = w.step(uncached)
        if len(chunks) == 1 and chunks[0][2] and w.todo[chunks[0][0]][0] == chunks[0][1]:
            self.capacity.prefill_sample(w.name, chunks[0][1], dt)  # one whole prompt: what prefill_s describes
        w.ending = [i for i, _, done in chunks if done]
        self.push(w.begin(now, dt), "prefilled", (w.name, w.version))

    def prefilled(self, name: str, version: int, now: float) -> None:
        w = self.prefill.get(name)
        if w is None or w.version != version:
            return  # stale: the host's stretch moved the step's end, or the worker left the pool since
        w.busy, w.done = False, w.done + 1
        m = self.model
        for i, first in w.held:  # hand-overs that waited for this step
            self.push(max(now, first) + m.handover_time_s(self.reqs[i].input_len) * self.stretch, "handed", i)
        w.held = []
        for i in w.ending:
            r = self.reqs[i]
            unc = w.finished(i)
            w.queued_tokens -= self.uncached.pop(i)
            w.store(r.hashes)
            self.pp.finish(self.placed.pop(i), now, r.input_len - unc)
            # The router streams the prefill's token at once, then hands the KV over; both are
            # work on the host's CPU, stretched as the steps are.
            self.times[i].prefilled = now
            self.times[i].first = now + m.request_time_s(r.input_len) * self.stretch
        next_step = bool(w.queue)  # another step starts now
        for i in w.ending:
            r, first = self.reqs[i], self.times[i].first
            if r.output_len <= 1:
                self.push(first, "handed", i)
            elif m.handover_waits_prefill_step and next_step:
                w.held.append((i, first))  # the hand-over waits for the next step's end
            else:
                self.push(first + m.handover_time_s(r.input_len) * self.stretch, "handed", i)
        w.ending = []
        if w.queue:
            self.start_prefill(w, now)
        elif name in self.act.draining:
            self.act.drained(name, now)

    # ----- decode -------------------------------------------------------------------------

    def handed(self, i: int, now: float) -> None:
        """The KV is on the decode side: the request takes a decode slot, or waits for one."""
        r = self.reqs[i]
        self.waiting.append((i, r.input_len, float(r.output_len - 1)))
        self.admit(now)
        if self.waiting and self.waiting[-1][0] == i:
            # No slot: the router places the decode side at arrival and refuses while that pool
            # is full, so a client's first token comes no earlier than a slot (set on admission).
            self.times[i].first = None

    def admit(self, now: float) -> None:
        """Hand waiting sequences to decode workers, first come first served."""
        while self.waiting:
            i, ctx, left = self.waiting[0]
            r = self.reqs[i]
            pl = self.dp.place(r.hashes, ctx, capacity=self.model.max_num_seqs)
            if pl is None:
                return
            w = self.decode[pl.worker]
            if not w.fits(ctx, int(left) + 1):
                self.dp.finish(pl)
                return
            self.waiting.popleft()
            w.advance(now)
            if self.times[i].first is None:
                self.times[i].first = now
            if left <= 0:
                self.dp.finish(pl)
                self.finish(i, now)
                continue
            self.placed[i] = pl
            w.admit(i, ctx, left, r.input_len + r.output_len)
            self.schedule(w, now)

    def schedule(self, w: SimDecode, now: float) -> None:
        t = w.next_finish(now)
        if t is not None:
            self.push(t, "decoded", (w.name, w.version))

    def decoded(self, name: str, version: int, now: float) -> None:
        w = self.decode.get(name)
        if w is None or w.version != version:
            return  # stale: the batch changed since
        w.advance(now)
        self.capacity.decode_sample(name, w.batch, int(w.context), w.step_s())
        for i in w.pop_finished():
            self.dp.finish(self.placed.pop(i))
            self.finish(i, now)
        self.schedule(w, now)
        self.admit(now)
        if name in self.act.draining and not w.batch:
            self.act.drained(name, now)

    def finish(self, i: int, now: float) -> None:
        t = self.times[i]
        t.done = now
        self.completed += 1
        r = self.reqs[i]
        self.recent.append((now, t.prefilled - t.arrival, (now - t.first) / (r.output_len - 1) if r.output_len > 1 else None))

    # ----- the controller and the actuator ------------------------------------------------------

    def signals(self, now: float, window: float) -> Signals:
        while self.arrivals and self.arrivals[0][0] < now - window:
            self.arrivals.popleft()
        while self.recent and self.recent[0][0] < now - window:
            self.recent.popleft()
        seqs = sum(w.batch for w in self.decode.values()) + len(self.waiting)
        ctx = sum(w.context for w in self.decode.values()) + sum(c for _, c, _ in self.waiting)
        ttfts = sorted(x[1] for x in self.recent)
        itls = sorted(x[2] for x in self.recent if x[2] is not None)
        live = [w for n, w in self.decode.items() if n not in self.act.draining]
        return Signals(
            now=now,
            prefill_workers=len([n for n in self.prefill if n not in self.act.draining]),
            decode_workers=len(live),
            arriving_prompt_tokens_s=sum(a[1] for a in self.arrivals) / window,
            arriving_requests_s=len(self.arrivals) / window,
            arriving_output_tokens_s=sum(a[3] for a in self.arrivals) / window,
            queued_prefill_tokens=sum(w.queued_tokens for w in self.prefill.values()),
            decode_seqs=seqs,
            decode_context_tokens=ctx,
            decode_kv_use=sum(w.reserved for w in live) / max(1, len(live) * self.model.kv_tokens),
            ttft_p90_ms=1000 * ttfts[int(0.9 * len(ttfts))] if ttfts else None,
            itl_p90_ms=1000 * itls[int(0.9 * len(itls))] if itls else None,
            change_in_flight=self.act.in_flight(),
            total_workers=len(self.prefill) + len(self.decode) + len(self.act.switching) + len(self.act.starting),
        )

    def tick(self, now: float) -> None:
        assert self.ctrl is not None
        interval = self.ctrl.interval_s
        s = self.signals(now, max(interval, self.cfg.window_s))
        d = self.ctrl.decide(s, self.capacity.estimate())
        if d.action != "hold" or d.close:
            self.decisions.append(d)
        self.act.apply(d, now)
        self.sample(now, s)
        if self.pending():
            self.push(now + interval, "tick")

    # ----- the host ---------------------------------------------------------------------------

    def restretch(self, now: float) -> None:
        """Workers sharing `cores`: the busy ones, the cluster's idle load and the serving path's
        CPU (router, relay) for the tokens streamed now, as engines, set the factor on every step."""
        busy = sum(1 for w in self.prefill.values() if w.busy) + sum(1 for w in self.decode.values() if w.batch)
        tokens_s = sum(w.batch / w.step_s() for w in self.decode.values() if w.batch)
        assert self.cfg.cores is not None
        m = self.model
        s = self.stretch = m.slowdown((busy + m.background_cores + tokens_s * m.serve_cpu_s_per_token) / self.cfg.cores)
        for w in self.prefill.values():
            if abs(w.stretch - s) > 1e-9:
                end = w.restretch(now, s)
                if end is not None:
                    self.push(end, "prefilled", (w.name, w.version))
        for d in self.decode.values():
            if abs(d.stretch - s) > 1e-9:
                d.restretch(now, s)
                self.schedule(d, now)

    # ----- the loop ---------------------------------------------------------------------------

    def sample(self, now: float, s: Signals | None) -> None:
        row = {"t": round(now, 3), "prefill": len(self.prefill) - sum(1 for n in self.act.draining if n in self.prefill),
               "decode": len(self.decode) - sum(1 for n in self.act.draining if n in self.decode)}
        if s is not None:
            row.update(rps=round(s.arriving_requests_s, 3), prompt_tok_s=round(s.arriving_prompt_tokens_s, 1),
                       output_tok_s=round(s.arriving_output_tokens_s, 1))
        self.timeline.append(row)

    def pending(self) -> bool:
        return self.completed < len(self.reqs)

    def run(self) -> SimResult:
        self.arrived = self.completed = 0
        for i, r in enumerate(self.reqs):
            self.push(r.t, "arrive", i)
        t0 = self.reqs[0].t
        self.push(t0, "tick" if self.ctrl is not None else "sample")
        handlers = {
            "prefilled": lambda now, p: self.prefilled(*p, now),
            "decoded": lambda now, p: self.decoded(*p, now),
            "deadline": lambda now, p: self.act.deadline(p, now),
            "handed": lambda now, p: self.handed(p, now),
            "switched": lambda now, p: self.act.switched(p, now),
            "started": lambda now, p: self.act.started(p, now),
            "tick": lambda now, p: self.tick(now),
        }
        last_report = 0
        while self.heap:
            now, _, kind, payload = heapq.heappop(self.heap)
            if kind == "arrive":
                self.arrive(payload, now)
                self.arrived += 1
                if self.progress is not None and self.arrived - last_report >= 2000:
                    last_report = self.arrived
                    self.progress(self.arrived / len(self.reqs))
            elif kind == "sample":
                self.sample(now, self.signals(now, self.cfg.window_s))
                if self.pending():
                    self.push(now + self.cfg.sample_s, "sample")
            else:
                handlers[kind](now, payload)
            if self.cfg.cores is not None:
                self.restretch(now)
        dwell = self.ctrl.dwell_s if self.ctrl is not None else 0.0
        return summarize(self.times, self.reqs, self.cfg.slo, self.act.flips, dwell, self.timeline, self.decisions)


def simulate(reqs: Sequence[SimRequest], model: PerfModel, cfg: SimConfig,
             progress: Callable[[float], None] | None = None) -> SimResult:
    return Simulation(reqs, model, cfg, progress).run()


def simulate_with_times(
    reqs: Sequence[SimRequest], model: PerfModel, cfg: SimConfig
) -> tuple[SimResult, list[RequestTimes]]:
    """As `simulate`, with each request's times too (in trace order), to set beside a real run's."""
    sim = Simulation(reqs, model, cfg, None)
    return sim.run(), sim.times
