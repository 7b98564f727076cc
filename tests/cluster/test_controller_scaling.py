"""--max-workers on a real Ray cluster on CPU: started 1 prefill + 1 decode with `--controller`
and `max_workers=3`, under a decode load over the ITL SLO that no flip can help (each pool has
its last worker), the controller adds a worker actor by itself. The streams running while it
starts and joins finish with exactly the offline tokens, every KV block is free afterwards, and
the add shows in Admin.GetController and in /metrics. Then a worker is removed through the same
scaler (as the policy asks after a lull) while streams run: they finish exactly, and the removal
waits for the actor's process to exit, the wait a CUDA cluster makes before a GPU counts free."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve import SamplingParams
from pdserve.cluster.config import ControllerSettings, ServeConfig
from pdserve.cluster.serve import Cluster
from pdserve.control.signals import Role, Slo
from pdserve.engine.args import EngineArgs
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

PROMPTS = [list(range(700 + 13 * i, 712 + 13 * i)) for i in range(8)]  # 12 tokens, 64 out, 8 streams
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cluster(loop_thread: Any) -> Iterator[Cluster]:
    # The ITL SLO is below what one CPU decode worker gives 8 streams; TTFT's is loose.
    cfg = ServeConfig(
        device="cpu", dtype="float32", port=0, metrics_port=0, num_prefill=1, num_decode=1,
        engine=EngineArgs(num_kv_blocks=192),
        controller=ControllerSettings(slo=Slo(ttft_ms=20000, itl_ms=40), min_interval_s=1.0, window_s=5.0, max_workers=3),
    )  # fmt: skip
    c = loop_thread.run(Cluster.start(cfg))
    yield c
    loop_thread.run(c.stop())


def stream(channel: grpc.Channel, ids: list[int]) -> list[int]:
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    chunks = pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params), timeout=300)
    return [t for c in chunks for t in c.token_ids]


def T(msg):
    import sys
    print(time.strftime("%H:%M:%S"), "TEST", msg, file=sys.stderr, flush=True)


def test_an_overload_no_flip_helps_adds_a_worker_actor(loop_thread, cluster, channel, offline, wait_until, blocks_free):
    T("call start")
    ctl = cluster.control.loop.controller
    orig = ctl.decide
    def decide(sig, m):
        d = orig(sig, m)
        T(f"decide {d.action} load p={d.load_prefill:.2f} d={d.load_decode:.2f} itl={sig.itl_p90_ms} seqs={sig.decode_seqs} req/s={sig.arriving_requests_s:.2f} {d.reason[:80]}")
        return d
    ctl.decide = decide
    want = [o.token_ids for o in offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    T("offline done")
    admin = pbg.AdminStub(channel)
    state = admin.GetController(pb.GetControllerRequest(), timeout=30)
    assert state.enabled and state.max_workers == 3 and state.workers_held == 2

    scaler = cluster.control.loop.scaler
    results: list[list[int]] = []
    expected: list[list[int]] = []
    deadline = time.monotonic() + 180
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        # Waves of decode streams until the added worker serves (or the deadline).
        while time.monotonic() < deadline:
            wave = [pool.submit(stream, channel, p) for p in PROMPTS]
            results += [f.result(timeout=300) for f in wave]
            expected += want
            T("wave done")
            if any(c.ok for c in scaler.changes):
                break
    assert results == expected, "a stream differs from offline generate"
    adds = [c for c in scaler.changes if c.action == "add"]
    state = admin.GetController(pb.GetControllerRequest(), timeout=30)
    assert adds and adds[0].ok, f"no add; decisions: {[d.reason for d in state.decisions]}"
    assert any(d.action == "add" and d.pool == adds[0].role for d in state.decisions)
    assert state.workers_held == 3 and state.prefill + state.decode == 3
    assert 0 < state.start_s

    # The new worker serves exactly (placement reaches it among the others), and everything is freed.
    T("seq16 start")
    assert [stream(channel, p) for p in PROMPTS * 2] == want * 2
    T("seq16 done")
    wait_until(blocks_free(channel), 30, "every KV block to be freed")

    with urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("pdserve_controller_decisions_total", (("action", "add"),))] >= 1
    pools = samples[("pdserve_pool_workers", (("role", "prefill"),))] + samples[("pdserve_pool_workers", (("role", "decode"),))]
    assert pools == 3

    # A removal under load: the loop stops first, so that it adds nothing meanwhile.
    loop_thread.run(cluster.control.loop.stop())
    scaler.gpu = True  # the removal waits for the process to exit, as on CUDA
    pool = Role(adds[0].role)

    async def remove() -> str | None:
        return scaler.remove(pool)

    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        wave = [ex.submit(stream, channel, p) for p in PROMPTS]
        T("removal wave start")
        gone = loop_thread.run(remove())
        assert gone is not None
        assert [f.result(timeout=300) for f in wave] == want
    wait_until(lambda: any(c.action == "remove" for c in scaler.changes), 120, "the removal to finish")
    T("removal done")
    removal = next(c for c in scaler.changes if c.action == "remove")
    assert removal.ok and removal.worker_id == gone, removal
    assert scaler.held() == 2 and gone not in {*cluster.router.pools.prefills, *cluster.router.pools.decodes}
    T("seq8 start")
    assert [stream(channel, p) for p in PROMPTS] == want
    T("seq8 done")
    wait_until(blocks_free(channel), 30, "every KV block to be freed")
