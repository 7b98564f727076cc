"""The P:D controller end to end on a real Ray cluster on CPU: started 2 prefill + 1 decode with
`--controller`, under a load that is all decoding (short prompts, long outputs, many streams),
it flips a prefill worker to decode by itself. The streams running through the flip finish with
exactly the offline tokens, every KV block is free afterwards, and the flip shows in
Admin.GetController, in /metrics and in a trace."""

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
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ControllerSettings, ServeConfig
from pdserve.control.signals import Slo
from pdserve.engine.args import EngineArgs
from pdserve.telemetry.tracing import TracingConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from tests.cluster.greedy_streams import greedy_stream, greedy_streams
from tests.cluster.otlp import OtlpReceiver

pytestmark = pytest.mark.cluster

# Decode-heavy: 12-token prompts, 48 tokens out each, 8 streams at a time. The controller sees
# the decode pool over its limit from the first wave's first tokens, so the streams need only be
# long enough to run through the flip.
PROMPTS = [list(range(500 + 13 * i, 512 + 13 * i)) for i in range(8)]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cluster(loop_thread: Any, ray_instance: Any, receiver: OtlpReceiver) -> Iterator[Cluster]:
    # The ITL SLO is below what one CPU decode worker gives 8 streams, and TTFT's is loose: the
    # decode pool is the one over its limit, the prefill pool idles.
    cfg = ServeConfig(
        device="cpu", dtype="float32", port=0, metrics_port=0, num_prefill=2, num_decode=1,
        engine=EngineArgs(num_kv_blocks=192),
        controller=ControllerSettings(slo=Slo(ttft_ms=20000, itl_ms=40), min_interval_s=1.0, window_s=5.0),
        tracing=TracingConfig(exporter="otlp-grpc", endpoint=receiver.endpoint, export_delay_s=0.2),
    )
    c = loop_thread.run(Cluster.start(cfg))
    yield c
    ray_instance.stop(c)


def stream(channel: grpc.Channel, ids: list[int]) -> list[int]:
    return greedy_stream(channel, ids, MAX_TOKENS)


def streams(channel: grpc.Channel, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_streams(channel, prompts, MAX_TOKENS)


def scrape(cluster: Cluster) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_decode_heavy_load_makes_the_controller_flip_a_prefill_worker(
    loop_thread, cluster, channel, offline, wait_until, blocks_free, receiver
):
    want = [o.token_ids for o in offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    admin = pbg.AdminStub(channel)
    state = admin.GetController(pb.GetControllerRequest(), timeout=30)
    assert state.enabled and (state.prefill, state.decode) == (2, 1)

    results: list[list[int]] = []
    expected: list[list[int]] = []
    deadline = time.monotonic() + 150
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        # Waves of decode-heavy streams until the controller has flipped (or the deadline).
        while time.monotonic() < deadline:
            wave = [pool.submit(stream, channel, p) for p in PROMPTS]
            results += [f.result(timeout=300) for f in wave]
            expected += want
            if any(c.ok for c in cluster.flipper.changes):
                break
    assert results == expected, "a stream differs from offline generate"
    flips = [c for c in cluster.flipper.changes if c.ok]
    assert flips, f"no flip; decisions: {[d.reason for d in admin.GetController(pb.GetControllerRequest()).decisions]}"
    assert (flips[0].from_role, flips[0].to_role) == ("prefill", "decode")
    assert len(cluster.router.pools.decodes) == 2 and len(cluster.router.pools.prefills) == 1

    state = admin.GetController(pb.GetControllerRequest(), timeout=30)
    assert (state.prefill, state.decode) == (1, 2) and state.target_decode >= 2
    assert any(d.action == "flip" and d.flip_from == "prefill" for d in state.decisions)
    assert [c.worker_id for c in state.changes if c.ok][:1] == [flips[0].worker_id]

    # The flipped worker serves decodes exactly (the streams run at once: placement spreads them
    # over both decode workers, where one at a time would each go to the first idle one), and
    # everything is freed.
    assert streams(channel, PROMPTS) == want
    wait_until(blocks_free(channel), 30, "every KV block to be freed")

    metrics = scrape(cluster)
    assert metrics[("pdserve_role_changes_total", (("from", "prefill"), ("to", "decode")))] >= 1
    assert metrics[("pdserve_pool_workers", (("role", "decode"),))] == 2

    loop_thread.run(cluster.flush_traces())
    wait_until(lambda: any(s.name == "pdserve.role_flip" for s in receiver.spans()), 30, "the flip's span")
