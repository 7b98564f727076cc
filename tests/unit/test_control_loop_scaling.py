"""The control loop's adds and removals (--max-workers) without processes: the real policy,
capacity fit and metrics, a scripted overload and a fake scaler (it records the adds asked for
and finishes them when the test says, as `WorkerScaler` would); and `room_for`, the check of
Ray's free resources."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from pdserve.cluster.control_loop import ControlLoop, Reading
from pdserve.cluster.scaler import ScaleChange, room_for
from pdserve.control.capacity import CapacityModel
from pdserve.control.perf_model import load_perf_model
from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Role, Signals, Slo
from pdserve.telemetry.metrics import RouterMetrics

MODEL = load_perf_model("smollm2-135m-cpu")


class FakeScaler:
    def __init__(self, room: int) -> None:
        self.room = room  # workers Ray has room for
        self.pools = {Role.PREFILL: 1, Role.DECODE: 1}
        self.starting: list[str] = []
        self.changes: list[ScaleChange] = []
        self.recorded = 0

    def held(self) -> int:
        return sum(self.pools.values()) + len(self.starting)

    def in_flight(self) -> bool:
        return bool(self.starting)

    def add(self, counts: Mapping[Role, int]) -> tuple[list[str], str | None]:
        want = [r.value for r, n in counts.items() for _ in range(n)]
        started, self.room = want[: self.room], max(0, self.room - len(want))
        self.starting += started
        return started, None if len(started) == len(want) else "Ray has 0 free CPU"

    def remove(self, pool: Role) -> str | None:
        return None

    def finish(self, seconds: float) -> None:
        for i, role in enumerate(self.starting):
            self.pools[Role(role)] += 1
            self.changes.append(ScaleChange("add", role, f"{role}-new{i}", True, seconds))
            self.recorded += 1
        self.starting = []


class Overload:
    """Decode-heavy overload on whatever pools the scaler has in placement."""

    def __init__(self, scaler: FakeScaler) -> None:
        self.scaler = scaler

    async def read(self, now: float, window_s: float) -> Reading:
        p, d = self.scaler.pools[Role.PREFILL], self.scaler.pools[Role.DECODE]
        return Reading(Signals(
            now=now, prefill_workers=p, decode_workers=d, arriving_prompt_tokens_s=20.0, arriving_requests_s=0.5,
            arriving_output_tokens_s=40.0, queued_prefill_tokens=0.0, decode_seqs=12, decode_context_tokens=12 * 120.0,
            decode_kv_use=0.05, itl_p90_ms=600.0,
        ))  # fmt: skip


def make(room: int):
    scaler = FakeScaler(room)
    cfg = ControllerConfig(workers=2, slo=Slo(5000, 200), max_workers=4)
    ctrl = Controller(cfg, flip_s=MODEL.flip_s, start_s=5.0)
    metrics = RouterMetrics()
    t = [0.0]
    loop = ControlLoop(ctrl, CapacityModel(MODEL), None, Overload(scaler), metrics, clock=lambda: t[0], scaler=scaler)
    return loop, scaler, metrics, t


async def run(loop: ControlLoop, t: list[float], n: int) -> list:
    out = []
    for _ in range(n):
        out.append(await loop.tick())
        t[0] += loop.interval_s
    return out


def test_an_overload_starts_workers_through_the_scaler_and_their_start_time_is_learnt():
    loop, scaler, metrics, t = make(room=4)
    decisions = asyncio.run(run(loop, t, 30))
    adds = [d for d in decisions if d.action == "add"]
    assert adds and scaler.starting and adds[0].pool is Role.DECODE
    assert scaler.held() <= 4
    assert all(d.action == "hold" for d in decisions[decisions.index(adds[0]) + 1 :])  # starting: in flight
    assert metrics.registry.get_sample_value("pdserve_controller_decisions_total", {"action": "add"}) == 1
    n = len(scaler.starting)
    scaler.finish(seconds=9.0)
    asyncio.run(run(loop, t, 1))
    want = 5.0
    for _ in range(n):  # each finished add's start time feeds the policy (an EWMA)
        want = 0.5 * want + 0.5 * 9.0
    assert loop.controller.start_s == want != 5.0
    assert loop.state().max_workers == 4 and loop.state().workers_held == scaler.held()
    assert any(d.pool == "decode" and d.action == "add" for d in loop.state().decisions)


def test_without_room_in_ray_the_add_is_a_hold_with_the_reason():
    loop, scaler, metrics, t = make(room=0)
    decisions = asyncio.run(run(loop, t, 30))
    assert not any(d.action == "add" for d in decisions) and not scaler.starting
    held = [d for d in decisions if "none started: Ray has 0 free CPU" in d.reason]
    assert held and all(d.action == "hold" and d.close for d in held)
    assert metrics.registry.get_sample_value("pdserve_controller_decisions_total", {"action": "add"}) == 0


def test_room_for_counts_a_gpu_on_cuda_and_the_threads_on_cpu():
    assert room_for({"GPU": 1.0, "CPU": 8.0}, gpu=True, cpus=0) is None
    assert room_for({"GPU": 1.0}, gpu=True, cpus=0, reserved=1) == "Ray has 0 free GPU for a worker needing 1"
    assert room_for({"CPU": 0.0}, gpu=True, cpus=0) is not None  # no GPU key: none free
    assert room_for({"CPU": 2.0}, gpu=False, cpus=2) is None
    assert room_for({"CPU": 2.0}, gpu=False, cpus=1, reserved=2) == "Ray has 0 free CPU for a worker needing 1"


def _serve_config(*argv: str):
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args

    return config_from_args(_build_parser().parse_args(["serve", *argv]))


def test_max_workers_parses_and_is_checked_naming_the_flag():
    import pytest

    cfg = _serve_config("--controller", "--max-workers", "5", "--prefill", "2", "--decode", "1")
    assert cfg.controller is not None and cfg.controller.max_workers == 5
    assert _serve_config("--controller").controller.max_workers is None
    with pytest.raises(ValueError, match=r"^--max-workers: 2 is below the 3 workers started \(--prefill \+ --decode\)"):
        _serve_config("--controller", "--max-workers", "2", "--prefill", "2", "--decode", "1")
    with pytest.raises(ValueError, match="^--max-workers: only with --controller"):
        _serve_config("--max-workers", "4")


def test_serve_help_names_max_workers():
    from pdserve.cli import _build_parser

    parser = _build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    text = " ".join(serve.format_help().split())
    assert "--max-workers N" in text and "where Ray has free resources" in text
