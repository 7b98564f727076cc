"""`--controller-colocated` end to end on a real Ray cluster on CPU: started 1 prefill + 1 decode,
under a load that is all decoding, the controller finds no prefill worker the best split and
flips the only one to decode. The cluster then serves colocated (each decode worker prefills its
own prompts), the streams running through the flip and those after it give exactly the offline
tokens, and every KV block is freed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ControllerSettings, ServeConfig
from pdserve.control.signals import Slo
from pdserve.engine.args import EngineArgs
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from tests.cluster.greedy_streams import greedy_stream, greedy_streams

pytestmark = pytest.mark.cluster

PROMPTS = [list(range(700 + 13 * i, 712 + 13 * i)) for i in range(8)]  # 12-token prompts
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(loop_thread: Any, ray_instance: Any) -> Iterator[Cluster]:
    # An ITL SLO one CPU decode worker cannot keep for 8 streams, a loose TTFT: one decode worker
    # is over its limit, and two colocated ones carrying the short prompts beside their decodes
    # are the better split.
    cfg = ServeConfig(
        device="cpu", dtype="float32", port=0, metrics_port=0, num_prefill=1, num_decode=1,
        engine=EngineArgs(num_kv_blocks=192),
        controller=ControllerSettings(slo=Slo(ttft_ms=20000, itl_ms=40), min_interval_s=1.0, window_s=5.0,
                                      colocated=True),
    )  # fmt: skip
    c = loop_thread.run(Cluster.start(cfg))
    yield c
    ray_instance.stop(c)


def test_a_decode_heavy_load_turns_a_1p1d_cluster_colocated(cluster, channel, offline, wait_until, blocks_free):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in offline.generate(PROMPTS, params)]
    admin = pbg.AdminStub(channel)
    assert (admin.GetController(pb.GetControllerRequest(), timeout=30).prefill, len(cluster.router.pools.decodes)) == (1, 1)

    results: list[list[int]] = []
    expected: list[list[int]] = []
    deadline = time.monotonic() + 150
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        while time.monotonic() < deadline:  # waves until the controller has flipped
            wave = [pool.submit(greedy_stream, channel, p, MAX_TOKENS) for p in PROMPTS]
            results += [f.result(timeout=300) for f in wave]
            expected += want
            if any(c.ok for c in cluster.flipper.changes):
                break
    assert results == expected, "a stream differs from offline generate"
    flips = [c for c in cluster.flipper.changes if c.ok]
    assert flips, f"no flip; decisions: {[d.reason for d in admin.GetController(pb.GetControllerRequest()).decisions]}"
    assert (flips[0].from_role, flips[0].to_role) == ("prefill", "decode")
    assert not cluster.router.pools.prefills and len(cluster.router.pools.decodes) == 2
    state = admin.GetController(pb.GetControllerRequest(), timeout=30)
    assert (state.prefill, state.decode) == (0, 2) and state.target_prefill == 0

    # Colocated now: every prompt is prefilled on its decode worker, with the offline tokens.
    local_before = cluster.router.placement_stats()["prefills"]["local"]
    assert greedy_streams(channel, PROMPTS, MAX_TOKENS) == want
    assert cluster.router.placement_stats()["prefills"]["local"] == local_before + len(PROMPTS)
    wait_until(blocks_free(channel), 30, "every KV block to be freed")
