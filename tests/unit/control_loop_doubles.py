"""Doubles of the live control loop's surroundings (a role flipper, a scripted signal source, a
clock) and a loop built over them: shared by the control loop's tests and the mode-choice gauge's."""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.cluster.control_loop import ControlLoop, Reading
from pdserve.control.capacity import CapacityModel
from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Role, Signals, Slo
from pdserve.router.handles import RouterError
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2 as pb

MODEL = load_perf_model("smollm2-135m-cpu")  # flip_s 1.0


class FakeActuator:
    """Fake role flipper: pools as lists, flips recorded, finished by `finish`."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.pools = {Role.PREFILL: list(prefill), Role.DECODE: list(decode)}
        self.flips: list[tuple[str, Role]] = []
        self.changes: list[pb.RoleChange] = []
        self.unhealthy: set[str] = set()
        self.current: tuple[str, Role] | None = None
        self.t = 1000.0

    def pick(self, donor: Role) -> str | None:
        pool = self.pools[donor]
        return pool[0] if len(pool) > 1 else None

    def flip(self, worker: str, to: Role) -> None:
        if self.current is not None:
            raise RuntimeError("a role flip is in flight")
        self.flips.append((worker, to))
        self.pools[to.other].remove(worker)
        self.current = (worker, to)

    def in_flight(self) -> bool:
        return self.current is not None

    def finish(self, ok: bool = True, drain_s: float = 3.0, switch_s: float = 1.0, probe_s: float = 1.0) -> None:
        assert self.current is not None
        worker, to = self.current
        self.current = None
        self.t += 1
        if ok:
            self.pools[to].append(worker)
        self.changes.append(pb.RoleChange(
            worker_id=worker, from_role=to.other.value, to_role=to.value, ok=ok, drain_s=drain_s, switch_s=switch_s,
            probe_s=probe_s, started_at=self.t, error="" if ok else "probe: failed",
        ))  # fmt: skip


class Script:
    """A signal source: prompt-heavy load on whatever pools the actuator has now, and one sequence
    decoding (which one decode worker carries within its limit, so a flip to prefill costs it nothing)."""

    def __init__(self, act: FakeActuator, prompt_tokens_s: float = 700.0, fail: int = 0) -> None:
        self.act = act
        self.prompt_tokens_s = prompt_tokens_s
        self.reads: list[tuple[float, float]] = []
        self.fail = fail  # the first `fail` reads raise

    async def read(self, now: float, window_s: float) -> Reading:
        self.reads.append((now, window_s))
        if len(self.reads) <= self.fail:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "stats: too slow")
        p, d = len(self.act.pools[Role.PREFILL]), len(self.act.pools[Role.DECODE])
        return Reading(Signals(
            now=now, prefill_workers=p, decode_workers=d, arriving_prompt_tokens_s=self.prompt_tokens_s,
            arriving_requests_s=self.prompt_tokens_s / 512, arriving_output_tokens_s=5.0, queued_prefill_tokens=0.0,
            decode_seqs=1, decode_context_tokens=600.0, decode_kv_use=0.05,
        ))  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_loop(act: FakeActuator | None, source: Any, min_interval_s: float = 2.0):
    metrics = RouterMetrics()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = Clock()
    # The loop's mechanics, not the policy's: without weighing a move's cost (tested in
    # test_controller_policy.py), a sustained load flips after `confirm` intervals.
    cfg = ControllerConfig(workers=4, slo=Slo(), min_interval_s=min_interval_s, weigh_cost=False)
    ctrl = Controller(cfg, flip_s=MODEL.flip_s)
    loop = ControlLoop(
        ctrl, CapacityModel(MODEL), act, source, metrics, provider.get_tracer("test"), window_s=10.0, clock=clock,
        wall=lambda: 1.8e9 + clock.t,
    )  # fmt: skip
    return loop, metrics, exporter, clock


async def ticks(loop: ControlLoop, clock: Clock, n: int) -> list:
    out = []
    for _ in range(n):
        out.append(await loop.tick())
        clock.t += loop.interval_s
    return out
