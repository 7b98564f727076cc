"""The live P:D controller: every interval, read the router's signals, let the pure policy
(`pdserve.control.controller.Controller`) decide, and start what it asks for through the role
flipper (the `Actuator`: one worker per flip decision, one flip in flight) or the scaler
(`--max-workers`). Each decision worth recording is logged, traced, counted and kept for
`Admin.GetController`; each finished flip or add feeds its measured time back to the policy and
marks the worker cold in the capacity fit (docs/controller.md, "The live loop").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from opentelemetry import trace

from pdserve.control.actuator import Actuator
from pdserve.control.capacity import CapacityModel
from pdserve.control.controller import Controller
from pdserve.control.mode_choice import mode_loads
from pdserve.control.perf_model import DEFAULT_MODEL
from pdserve.control.signals import Decision, Role, Signals
from pdserve.router.router import Router
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2

log = logging.getLogger(__name__)

CPU_MODEL = "smollm2-135m-cpu"


def default_perf_model(device: str) -> str:
    """The built-in performance model for a cluster on `device`: the measured CPU model on CPU,
    the GPU default elsewhere."""
    return DEFAULT_MODEL if device.startswith("cuda") else CPU_MODEL


class FlipActuator(Actuator, Protocol):
    """The role flipper as the loop sees it: the Actuator and the record of finished flips."""

    changes: list[inference_pb2.RoleChange]


class Scaler(Protocol):
    """The worker scaler as the loop sees it (`pdserve.cluster.scaler.WorkerScaler`)."""

    changes: list  # the last ScaleChanges (action, role, worker_id, ok, seconds, started_at)
    recorded: int  # how many were ever recorded

    def held(self) -> int: ...

    def in_flight(self) -> bool: ...

    def add(self, counts: Mapping[Role, int]) -> tuple[list[str], str | None]: ...

    def remove(self, pool: Role) -> str | None: ...


@dataclass(frozen=True)
class PrefillSample:
    worker: str
    tokens: int  # computed, not served from the prefix cache
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    worker: str
    batch: int
    context_tokens: int
    seconds: float  # one decode step


@dataclass(frozen=True)
class Reading:
    """One interval's signals (`change_in_flight` is the loop's to fill) and the timings since
    the last reading, for the capacity fit."""

    signals: Signals
    prefill: tuple[PrefillSample, ...] = ()
    decode: tuple[DecodeSample, ...] = ()


class SignalSource(Protocol):
    async def read(self, now: float, window_s: float) -> Reading: ...


class RouterSignals:
    """The live source: the router's `LoadSignals`, the decode workers' stats under a deadline.

    A decode step's time is read from the pool's median inter-token latency over the window,
    against each decode worker's own batch and context: the router times streams, not steps,
    and a stream gains one token per step of its worker."""

    def __init__(self, router: Router, timeout_s: float) -> None:
        self.router = router
        self.timeout_s = timeout_s

    async def read(self, now: float, window_s: float) -> Reading:
        load = await self.router.load.read(now, window_s, self.timeout_s)
        a, lat = load.arrivals, load.latencies
        signals = Signals(
            now=now,
            prefill_workers=load.prefill_workers,
            decode_workers=load.decode_workers,
            arriving_prompt_tokens_s=a.prompt_tokens_s,
            arriving_requests_s=a.requests_s,
            arriving_output_tokens_s=a.output_tokens_s,
            queued_prefill_tokens=load.queued_prefill_tokens,
            decode_seqs=load.decode_seqs,
            decode_context_tokens=load.decode_context_tokens,
            decode_kv_use=load.decode_kv_use,
            ttft_p90_ms=lat.ttft_p90_ms,
            itl_p90_ms=lat.itl_p90_ms,
        )
        prefill = tuple(PrefillSample(p.worker, p.tokens, p.seconds) for p in load.prefill_times)
        decode: tuple[DecodeSample, ...] = ()
        if lat.itl_p50_ms is not None:
            step_s = lat.itl_p50_ms / 1000
            decode = tuple(
                DecodeSample(d.worker, d.running, d.context_tokens, step_s)
                for d in load.decode
                if d.in_placement and d.running > 0
            )
        return Reading(signals, prefill, decode)


def decision_pb(t_unix: float, d: Decision) -> inference_pb2.ControllerDecision:
    return inference_pb2.ControllerDecision(
        t=t_unix, action=d.action, reason=d.reason, prefill=d.prefill, decode=d.decode,
        target_prefill=d.target_prefill, target_decode=d.target_decode,
        flip_from="" if d.flip_from is None else d.flip_from.value, count=d.count,
        load_prefill=d.load_prefill, load_decode=d.load_decode, pool="" if d.pool is None else d.pool.value,
    )  # fmt: skip


class ControlLoop:
    """`tick()` is one interval; `start()` runs them until `stop()`. `actuator` None: decisions
    are made and recorded, nothing flips (a server without a role flipper)."""

    def __init__(
        self,
        controller: Controller,
        capacity: CapacityModel,
        actuator: FlipActuator | None,
        source: SignalSource,
        metrics: RouterMetrics,
        tracer: trace.Tracer | None = None,
        window_s: float = 10.0,
        history: int = 50,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        scaler: Scaler | None = None,
    ) -> None:
        self.controller = controller
        self.capacity = capacity
        self.actuator = actuator
        self.source = source
        self.metrics = metrics
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self.window_s = window_s
        self.clock, self.wall = clock, wall
        self.decisions: deque[tuple[float, Decision]] = deque(maxlen=history)  # (unix seconds, decision)
        self.last: Decision | None = None
        self._seen: tuple[str, float] | None = None  # the newest flip already taken into account
        self.scaler = scaler
        self._scale_seen = 0  # scaler changes already taken into account (`Scaler.recorded`)
        self._task: asyncio.Task | None = None

    @property
    def interval_s(self) -> float:
        return self.controller.interval_s

    async def tick(self) -> Decision:
        self._observe_flips()
        self._observe_scaling()
        now = self.clock()
        reading = await self.source.read(now, max(self.interval_s, self.window_s))
        for p in reading.prefill:
            self.capacity.prefill_sample(p.worker, p.tokens, p.seconds)
        for s in reading.decode:
            self.capacity.decode_sample(s.worker, s.batch, s.context_tokens, s.seconds)
        in_flight = self.actuator.in_flight() if self.actuator is not None else False
        in_flight = in_flight or (self.scaler is not None and self.scaler.in_flight())
        held = self.scaler.held() if self.scaler is not None else None
        signals = replace(reading.signals, change_in_flight=in_flight, total_workers=held)
        model = self.capacity.estimate()
        d = self.controller.decide(signals, model)
        worker = None
        if d.action == "flip":
            worker = self._act(d)
        elif d.action in ("add", "remove"):
            d, worker = self._scale(d)
        self.last = d
        self.metrics.pool_target.labels("prefill").set(d.target_prefill)
        self.metrics.pool_target.labels("decode").set(d.target_decode)
        modes = mode_loads(signals, model, self.controller.cfg)
        self.metrics.mode_load.labels("colocated").set(modes.colocated)
        self.metrics.mode_load.labels("disaggregated").set(modes.disaggregated)
        if d.action != "hold" or d.close:
            self._record(d, worker)
        return d

    def _scale(self, d: Decision) -> tuple[Decision, str | None]:
        """Start the adds or the removal; what was done (a hold, with the reason, where Ray has no
        room or no worker may leave) and the workers it concerns."""
        if self.scaler is None:
            return replace(d, action="hold", close=True, reason=f"{d.reason}; no worker scaler here"), None
        if d.action == "add":
            counts = {Role.PREFILL: d.target_prefill - d.prefill, Role.DECODE: d.target_decode - d.decode}
            started, why = self.scaler.add(counts)
            if not started:
                log.info("controller: add wanted, not started: %s", why)
                return replace(d, action="hold", close=True, reason=f"{d.reason}; none started: {why}"), None
            if why is not None:
                d = replace(d, count=len(started), reason=f"{d.reason}; {len(started)} started: {why}")
            return d, ",".join(started)
        assert d.pool is not None
        worker = self.scaler.remove(d.pool)
        if worker is None:
            return replace(d, action="hold", close=True, reason=f"{d.reason}; no {d.pool.value} worker may leave"), None
        return d, worker

    def _act(self, d: Decision) -> str | None:
        """Start the flip of one worker of the donor pool; the worker, or None if none went."""
        if d.flip_from is None or self.actuator is None:
            log.warning("controller: flip %s wanted, but this server has no role flipper", d.flip_from)
            return None
        worker = self.actuator.pick(d.flip_from)
        if worker is None:
            log.info("controller: no %s worker can leave its pool now", d.flip_from.value)
            return None
        try:
            self.actuator.flip(worker, d.flip_from.other)
        except (RuntimeError, ValueError) as exc:  # a flip by hand got there first, or the pool changed
            log.warning("controller: flipping %s refused: %s", worker, exc)
            return None
        return worker

    def _record(self, d: Decision, worker: str | None) -> None:
        self.decisions.append((self.wall(), d))
        self.metrics.controller_decisions.labels(d.action).inc()
        moved = f" ({worker})" if worker else ""
        log.info(
            "controller: %s%s at %dP:%dD, target %dP:%dD: %s",
            d.action, moved, d.prefill, d.decode, d.target_prefill, d.target_decode, d.reason,
        )  # fmt: skip
        attrs = {k: v for k, v in d.as_dict().items() if v is not None}
        if worker:
            attrs["worker_id"] = worker
        span = self.tracer.start_span("pdserve.controller", attributes={"pdserve.controller.action": d.action})
        span.add_event("decision", attrs)
        span.end()

    def _observe_flips(self) -> None:
        """Flips finished since the last interval (by the controller or by hand): their time
        feeds the interval, and the worker's capacity samples start cold."""
        if self.actuator is None:
            return
        changes = list(self.actuator.changes)
        keys = [(c.worker_id, c.started_at) for c in changes]
        start = keys.index(self._seen) + 1 if self._seen in keys else 0
        for c in changes[start:]:
            if c.ok:
                self.controller.observe_flip(c.drain_s + c.switch_s + c.probe_s)
                self.capacity.started(c.worker_id)
            else:
                self.capacity.forget(c.worker_id)
        if keys:
            self._seen = keys[-1]

    def _observe_scaling(self) -> None:
        """Adds and removals finished since the last interval: an add's start time feeds the
        policy and its worker starts cold in the capacity fit; a removed worker is forgotten."""
        if self.scaler is None:
            return
        fresh = self.scaler.recorded - self._scale_seen
        new = self.scaler.changes[-fresh:] if fresh > 0 else []
        for c in new:
            if c.action == "add" and c.ok:
                self.controller.observe_start(c.seconds)
                self.capacity.started(c.worker_id)
            elif c.action == "remove":
                self.capacity.forget(c.worker_id)
        self._scale_seen = self.scaler.recorded

    # ----- running ------------------------------------------------------------------------

    def start(self) -> None:
        self._observe_flips()  # flips before the start are history, not this loop's to learn from twice
        if (refusal := self.controller.cfg.flip_refusal) is not None:
            log.warning("controller: no role flips: %s; the split moves only by adding and removing workers "
                        "(--max-workers)", refusal)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("controller: an interval failed; trying again at the next")
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def state(self) -> inference_pb2.ControllerState:
        """The controller's part of `Admin.GetController` (pools, changes: the control plane's)."""
        st = inference_pb2.ControllerState(
            enabled=True, interval_s=self.interval_s, flip_s=self.controller.flip_s,
            decisions=[decision_pb(t, d) for t, d in self.decisions],
        )  # fmt: skip
        if self.last is not None:
            st.target_prefill, st.target_decode = self.last.target_prefill, self.last.target_decode
        st.max_workers = self.controller.cfg.max_workers or 0
        st.flips_refused = self.controller.cfg.flip_refusal or ""
        st.start_s = self.controller.start_s
        if self.scaler is not None:
            st.workers_held = self.scaler.held()
        return st
