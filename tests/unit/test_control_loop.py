"""The live controller loop without processes: the real policy, capacity fit, metrics and
tracer, driven by a scripted signal source and a fake actuator (a fake: it records the flips
asked for and finishes them when the test says, as the role flipper would). Also the cluster's
control plane (`ClusterControl`) over a real, unstarted router with a fake flipper."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from pdserve.cluster.admin_control import ClusterControl
from pdserve.cluster.control_loop import default_perf_model
from pdserve.control.perf_model import DEFAULT_MODEL
from pdserve.control.signals import Role
from pdserve.router.handles import RouterError
from pdserve.router.router import Router, RouterConfig
from pdserve_proto import inference_pb2 as pb
from tests.unit.control_loop_doubles import MODEL, FakeActuator, Script, make_loop, ticks


def test_a_prompt_heavy_load_flips_one_decode_worker_and_records_it():
    act = FakeActuator(["p0", "p1"], ["d0", "d1"])
    loop, metrics, exporter, clock = make_loop(act, Script(act))
    first, second = asyncio.run(ticks(loop, clock, 2))
    assert first.action == "hold" and first.close and "1/2" in first.reason  # confirmation pending
    assert second.action == "flip" and second.flip_from is Role.DECODE
    assert act.flips == [("d0", Role.PREFILL)]  # one worker per decision
    assert [d.action for _, d in loop.decisions] == ["hold", "flip"]
    value = metrics.registry.get_sample_value
    assert value("pdserve_pool_target", {"role": "prefill"}) == second.target_prefill >= 3
    assert value("pdserve_pool_target", {"role": "decode"}) == second.target_decode
    assert value("pdserve_controller_decisions_total", {"action": "flip"}) == 1
    assert value("pdserve_controller_decisions_total", {"action": "hold"}) == 1
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["pdserve.controller"] * 2
    event = spans[1].events[0]
    assert event.name == "decision" and event.attributes["action"] == "flip"
    assert event.attributes["flip_from"] == "decode" and event.attributes["worker_id"] == "d0"
    st = loop.state()
    assert st.enabled and [d.action for d in st.decisions] == ["hold", "flip"]
    assert st.decisions[1].flip_from == "decode" and st.decisions[1].t == pytest.approx(1.8e9 + 2.0)
    assert (st.target_prefill, st.target_decode) == (second.target_prefill, second.target_decode)
    assert loop.source.reads[0][1] == 10.0  # the window: max(interval, window_s)


def test_one_change_in_flight_then_the_flip_time_feeds_the_interval_and_the_worker_starts_cold():
    act = FakeActuator(["p0", "p1"], ["d0", "d1", "d2"])
    loop, _, _, clock = make_loop(act, Script(act, prompt_tokens_s=1400.0))
    asyncio.run(ticks(loop, clock, 2))
    assert act.flips == [("d0", Role.PREFILL)]
    held = asyncio.run(ticks(loop, clock, 3))
    assert all(d.action == "hold" and d.reason == "a change is in flight" for d in held)
    assert act.flips == [("d0", Role.PREFILL)]
    for _ in range(10):  # d0 was warm before the flip
        loop.capacity.prefill_sample("d0", 512, 1.4)
    assert loop.capacity.prefill_sample("d0", 512, 1.4)
    act.finish(drain_s=3.0, switch_s=1.0, probe_s=1.0)  # 5 s in all
    asyncio.run(ticks(loop, clock, 1))
    learnt = 0.5 * MODEL.flip_s + 0.5 * 5.0  # the EWMA of the model's flip time and the measured one
    assert loop.controller.flip_s == pytest.approx(learnt)
    assert loop.interval_s == pytest.approx(max(2.0, learnt))
    assert not loop.capacity.prefill_sample("d0", 512, 1.4)  # cold again: its old samples no longer count
    asyncio.run(ticks(loop, clock, 1))
    assert loop.controller.flip_s == pytest.approx(learnt)  # a flip is learnt once


def test_a_failed_flip_teaches_no_flip_time():
    act = FakeActuator(["p0", "p1"], ["d0", "d1"])
    loop, _, _, clock = make_loop(act, Script(act))
    asyncio.run(ticks(loop, clock, 2))
    act.finish(ok=False, drain_s=50.0)
    asyncio.run(ticks(loop, clock, 1))
    assert loop.controller.flip_s == MODEL.flip_s


def test_without_an_actuator_decisions_are_recorded_and_nothing_flips():
    act = FakeActuator(["p0", "p1"], ["d0", "d1"])  # only the source reads its pools
    loop, metrics, _, clock = make_loop(None, Script(act))
    decisions = asyncio.run(ticks(loop, clock, 2))
    assert decisions[1].action == "flip" and act.flips == []
    assert metrics.registry.get_sample_value("pdserve_controller_decisions_total", {"action": "flip"}) == 1


def test_the_loop_runs_every_interval_survives_a_failed_read_and_stops():
    act = FakeActuator(["p0", "p1"], ["d0", "d1"])
    source = Script(act, fail=1)

    async def go() -> None:
        loop, _, _, _ = make_loop(act, source, min_interval_s=0.01)
        loop.controller.flip_s = 0.0
        loop.start()
        await asyncio.sleep(0.3)
        await loop.stop()
        n = len(source.reads)
        await asyncio.sleep(0.05)
        assert len(source.reads) == n  # stopped
        assert n >= 3  # the failed first read did not end the loop
        assert act.flips == [("d0", Role.PREFILL)]

    asyncio.run(go())


def test_default_perf_model_follows_the_device():
    assert default_perf_model("cpu") == "smollm2-135m-cpu"
    assert default_perf_model("cuda") == default_perf_model("cuda:1") == DEFAULT_MODEL


# ----- the cluster's control plane -----------------------------------------------------------


class Stub:
    """A worker handle the router never calls (it is not started)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


class FakeFlipper(FakeActuator):
    """Fake: `change` records the request and answers a finished flip."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        super().__init__(prefill, decode)
        self.asked: list[tuple[str, str, float | None]] = []

    async def change(self, worker_id: str, role: str, drain_timeout_s: float | None) -> pb.RoleChange:
        self.asked.append((worker_id, role, drain_timeout_s))
        if role == "prefill" and worker_id.startswith("p"):
            raise ValueError(f"role: {worker_id} is already a prefill worker")
        c = pb.RoleChange(worker_id=worker_id, to_role=role, ok=True)
        self.changes.append(c)
        return c


def router() -> Router:
    cfg = RouterConfig(model_id="m", max_model_len=64, vocab_size=100)
    return Router(cfg, None, [Stub("p0")], [Stub("d0"), Stub("d1")])  # type: ignore[list-item]


def code_of(coro: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(RouterError) as err:
        asyncio.run(coro)
    return err.value.code, err.value.message


def test_cluster_control_checks_the_worker_and_the_flip_in_flight():
    flipper = FakeFlipper(["p0"], ["d0", "d1"])
    plane = ClusterControl(router(), flipper)
    code, msg = code_of(plane.set_role("nope", "prefill", None))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("worker_id:") and "d0, d1, p0" in msg
    code, msg = code_of(plane.set_role("p0", "prefill", None))  # the flipper's own refusal
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("role:")
    assert asyncio.run(plane.set_role("d1", "prefill", 5.0)).ok
    assert flipper.asked[-1] == ("d1", "prefill", 5.0)
    flipper.current = ("d0", Role.PREFILL)
    code, msg = code_of(plane.set_role("d0", "prefill", None))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "in flight" in msg
    st = plane.controller_state()
    assert not st.enabled and (st.prefill, st.decode) == (1, 2) and [c.worker_id for c in st.changes] == ["d1"]
    flipper.unhealthy.add("d0")
    assert list(plane.controller_state().unhealthy) == ["d0"]


def test_cluster_control_without_a_flipper_refuses_set_role():
    code, msg = code_of(ClusterControl(router()).set_role("d0", "prefill", None))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and msg.startswith("no role flips in this server")


# ----- the Admin service over a real gRPC server -----------------------------------------------

DATA, ADMIN = "data-key", "admin-key"


async def _call(coro: Any) -> tuple[grpc.StatusCode, str]:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_admin_set_role_and_get_controller_over_grpc():
    from pdserve.router.edge.auth import ApiKeys
    from pdserve.router.edge.grpc_server import start_grpc_server
    from pdserve_proto import inference_pb2_grpc as pbg

    async def go() -> None:
        r = router()
        flipper = FakeFlipper(["p0"], ["d0", "d1"])
        keys = ApiKeys(data=(DATA,), admin=(ADMIN,))
        with_plane, port = await start_grpc_server(r, "127.0.0.1", 0, keys=keys, control=ClusterControl(r, flipper))
        bare, bare_port = await start_grpc_server(r, "127.0.0.1", 0)
        admin_md = [("authorization", f"Bearer {ADMIN}")]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                admin = pbg.AdminStub(ch)
                req = pb.SetRoleRequest(worker_id="d1", role="prefill")
                data_md = [("authorization", f"Bearer {DATA}")]
                assert (await _call(admin.SetRole(req, metadata=data_md)))[0] == grpc.StatusCode.PERMISSION_DENIED
                assert flipper.asked == []  # refused before the servicer
                code, msg = await _call(
                    admin.SetRole(pb.SetRoleRequest(worker_id="d1", role="both"), metadata=admin_md)
                )
                assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("role:")
                code, msg = await _call(
                    admin.SetRole(pb.SetRoleRequest(worker_id="x", role="decode"), metadata=admin_md)
                )
                assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("worker_id:")
                reply = await admin.SetRole(req, metadata=admin_md)
                assert reply.change.ok and flipper.asked == [("d1", "prefill", None)]  # 0: the flipper's default
                st = await admin.GetController(pb.GetControllerRequest(), metadata=admin_md)
                assert not st.enabled and (st.prefill, st.decode) == (1, 2) and st.changes[0].worker_id == "d1"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{bare_port}") as ch:
                admin = pbg.AdminStub(ch)
                code, msg = await _call(admin.SetRole(pb.SetRoleRequest(worker_id="d1", role="prefill")))
                assert code == grpc.StatusCode.FAILED_PRECONDITION and msg == "no role flips in this server"
                st = await admin.GetController(pb.GetControllerRequest())
                assert not st.enabled and (st.prefill, st.decode) == (1, 2) and not st.changes
        finally:
            await with_plane.stop(0)
            await bare.stop(0)

    asyncio.run(go())


def test_the_controller_metrics_pass_promtool():
    import shutil
    import subprocess
    from pathlib import Path

    from prometheus_client import generate_latest

    act = FakeActuator(["p0", "p1"], ["d0", "d1"])
    loop, metrics, _, clock = make_loop(act, Script(act))
    asyncio.run(ticks(loop, clock, 2))
    metrics.role_changes.labels("decode", "prefill").inc()
    text = generate_latest(metrics.registry).decode()
    assert (
        'pdserve_pool_target{role="prefill"}' in text
        and 'pdserve_role_changes_total{from="decode",to="prefill"} 1.0' in text
    )
    root = Path(__file__).resolve().parents[2]
    tool = shutil.which("promtool") or str(root / ".tools/prometheus/usr/bin/promtool")
    assert Path(tool).exists(), "promtool not found: run the set-up command of the README (scripts/setup.sh)"
    check = subprocess.run(
        [tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False
    )
    problems = [line for line in (check.stdout + check.stderr).splitlines() if "pdserve_" in line]
    assert check.returncode in (0, 3) and not problems, check.stdout + check.stderr
