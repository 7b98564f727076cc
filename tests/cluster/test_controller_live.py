"""The live P:D controller on real workers in this process (real engines, real NIXL, real gRPC):
the router's signals after real requests, one interval of the control loop on them, and
Admin.GetController over gRPC; and `pdserve serve --controller` through the command line. The
end-to-end flip under load is the role flipper's test."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.cluster.admin_control import ClusterControl, build_control_loop
from pdserve.cluster.serve_config import ControllerSettings
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Slo
from pdserve.router.edge.grpc_server import start_grpc_server
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(100 + 40 * i, 160 + 40 * i)) for i in range(4)]  # 60 tokens each, no shared prefix
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(start_shared_in_process: Any, loop_thread: Any) -> Any:
    """An in-process cluster (1 prefill, 1 decode) with a controller loop that is not started:
    the test runs its intervals. No role flipper: it is the integrator's."""
    cluster = start_shared_in_process(serve=False)
    settings = ControllerSettings(slo=Slo(ttft_ms=5000, itl_ms=500), min_interval_s=2.0, window_s=60.0)
    loop = build_control_loop(settings, cluster.router, None, 2, "cpu", cluster.router.metrics)
    control = ClusterControl(cluster.router, None, loop)
    server, port = loop_thread.run(start_grpc_server(cluster.router, "127.0.0.1", 0, control=control))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield cluster, loop, channel
    channel.close()
    loop_thread.run(server.stop(0))


def test_signals_from_real_requests_and_get_controller_over_grpc(served, loop_thread):
    cluster, loop, channel = served
    stub, admin = pbg.InferenceStub(channel), pbg.AdminStub(channel)
    before = admin.GetController(pb.GetControllerRequest(), timeout=30)
    assert before.enabled and (before.prefill, before.decode) == (1, 1) and not before.decisions

    for i, ids in enumerate(PROMPTS):
        request = pb.GenerateRequest(
            request_id=f"ctl-{i}", prompt_token_ids=ids,
            sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        )  # fmt: skip
        chunks = list(stub.Generate(request, timeout=120))
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS

    reading = loop_thread.run(loop.source.read(time.monotonic(), 60.0))
    s = reading.signals
    assert (s.prefill_workers, s.decode_workers) == (1, 1)
    assert s.arriving_requests_s == pytest.approx(len(PROMPTS) / 60.0)
    # Nothing was cached: every prompt token arrives as prefill work; each asks for MAX_TOKENS.
    assert s.arriving_prompt_tokens_s == pytest.approx(sum(map(len, PROMPTS)) / 60.0)
    assert s.arriving_output_tokens_s == pytest.approx(len(PROMPTS) * MAX_TOKENS / 60.0)
    assert s.queued_prefill_tokens == 0 and s.decode_seqs == 0  # all done
    assert s.ttft_p90_ms is not None and s.ttft_p90_ms > 0
    assert s.itl_p90_ms is not None and s.itl_p90_ms > 0
    assert [(p.worker, p.tokens) for p in reading.prefill] == [("prefill-0", len(ids)) for ids in PROMPTS]
    assert all(0 < p.seconds < 60 for p in reading.prefill)

    decision = loop_thread.run(loop.tick())
    assert decision.prefill == 1 and decision.decode == 1
    assert decision.target_prefill + decision.target_decode == 2
    metrics = cluster.router.metrics.registry.get_sample_value
    assert metrics("pdserve_pool_workers", {"role": "prefill"}) == 1
    assert metrics("pdserve_pool_workers", {"role": "decode"}) == 1
    assert metrics("pdserve_pool_target", {"role": "decode"}) == decision.target_decode

    st = admin.GetController(pb.GetControllerRequest(), timeout=30)
    assert st.enabled and (st.prefill, st.decode) == (1, 1)
    assert (st.target_prefill, st.target_decode) == (decision.target_prefill, decision.target_decode)
    # No flip measured yet: the CPU model's flip time.
    assert st.interval_s >= 2.0 and st.flip_s == pytest.approx(load_perf_model("smollm2-135m-cpu").flip_s)
    code = None
    try:
        admin.SetRole(pb.SetRoleRequest(worker_id="decode-0", role="prefill"), timeout=30)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("no role flips in this server")


def test_serve_help_shows_the_controller_flags():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for flag in (
        "--controller",
        "--slo-ttft-ms",
        "--slo-itl-ms",
        "--perf-model NAME|FILE",
        "--controller-interval-s S",
    ):
        assert flag in text
    assert "(default: 2000)" in text and "smollm2-135m-cpu on CPU" in text


def _serve_args(*argv: str) -> argparse.Namespace:
    from pdserve.cli import _build_parser

    return _build_parser().parse_args(["serve", *argv])


def test_controller_flags_parse_into_the_serve_config():
    from pdserve.cluster.main import config_from_args

    assert config_from_args(_serve_args()).controller is None
    cfg = config_from_args(_serve_args(
        "--controller", "--slo-ttft-ms", "800", "--slo-itl-ms", "40", "--perf-model", "smollm2-135m-cpu",
        "--controller-interval-s", "5", "--prefill", "2", "--decode", "2",
    ))  # fmt: skip
    assert cfg.controller == ControllerSettings(
        slo=Slo(ttft_ms=800, itl_ms=40), perf_model="smollm2-135m-cpu", min_interval_s=5.0
    )
    with pytest.raises(ValueError, match="^controller: needs a prefill pool"):
        config_from_args(_serve_args("--controller", "--prefill", "0"))
    # Allowed to serve colocated, it may start colocated too (and add a prefill pool by a flip).
    colocated = config_from_args(_serve_args("--controller", "--controller-colocated", "--prefill", "0"))
    assert colocated.controller == ControllerSettings(colocated=True) and colocated.num_prefill == 0


def test_a_wrong_perf_model_or_slo_fails_before_anything_starts():
    for argv, said in ((["--perf-model", "no-such-model"], "perf model"), (["--slo-itl-ms", "0"], "slo:")):
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "serve", "--controller", *argv],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert out.returncode == 2 and said in out.stderr, out.stderr
        assert "starting Ray" not in out.stdout + out.stderr
