"""In-place role flips on a real Ray cluster on CPU (2 prefill + 1 decode to start).

Streams running while a worker flips finish with exactly the offline tokens, whether their
decode worker drained in time or they moved to another one at the drain deadline; every KV
block is free afterwards; the worker keeps its engine (its prefix cache answers in the new role);
the flip is counted in /metrics and traced; a refused flip names the field."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve import SamplingParams
from pdserve.cluster.role_flip import FlipInFlight, FlipRefused
from pdserve.cluster.serve import Cluster
from tests.cluster.greedy_streams import greedy_stream, greedy_streams
from tests.cluster.otlp import OtlpReceiver

pytestmark = pytest.mark.cluster

PROMPTS = [list(range(300 + 40 * i, 300 + 40 * i + 24 + 7 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def receiver(otlp_receiver: OtlpReceiver) -> OtlpReceiver:
    return otlp_receiver  # the shared cluster's traces' endpoint


@pytest.fixture(scope="module")
def cluster(two_prefill_cluster: Cluster) -> Cluster:
    # Shared with test_cache_aware (tests/cluster/conftest.py), which adds and removes a prefill
    # worker but flips none: the flip counts and epochs below start from it as from a new cluster.
    return two_prefill_cluster


def stream(channel: grpc.Channel, ids: list[int], max_tokens: int) -> list[int]:
    return greedy_stream(channel, ids, max_tokens, timeout_s=180)


def expected(offline: Any, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in offline.generate(PROMPTS, params)]


def pools(cluster: Cluster) -> tuple[list[str], list[str]]:
    return sorted(cluster.router.pools.prefills), sorted(cluster.router.pools.decodes)


def role_changes(cluster: Cluster) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve_role_changes_total":
                out[(s.labels["from"], s.labels["to"])] = s.value
    return out


def test_flip_prefill_to_decode_under_load_then_back_moving_streams(
    loop_thread, cluster, channel, offline, wait_until, blocks_free, receiver
):
    assert pools(cluster) == (["prefill-0", "prefill-1"], ["decode-0"])
    want = expected(offline, 48)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        running = [pool.submit(stream, channel, p, 48) for p in PROMPTS]
        change = loop_thread.run(cluster.flipper.change("prefill-1", "decode"))
        assert change.ok, change.error
        got = [f.result(timeout=180) for f in running]
    assert got == want, "a stream running during the flip differs from offline generate"
    assert pools(cluster) == (["prefill-0"], ["decode-0", "prefill-1"])
    assert change.epoch == 1 and change.drain_s >= 0 and change.switch_s > 0 and change.probe_s > 0

    # Back again, with a drain deadline too short for the streams: they move to decode-0 and
    # resume there from the tokens already sent.
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        running = [pool.submit(stream, channel, p, 48) for p in PROMPTS]
        wait_until(lambda: cluster.router.pools.busy("prefill-1") > 0, 60, "a stream on the flipped worker")
        back = loop_thread.run(cluster.flipper.change("prefill-1", "prefill", drain_timeout_s=0.05))
        assert back.ok, back.error
        got = [f.result(timeout=180) for f in running]
    assert got == want, "a stream moved off a flipping decode worker differs from offline generate"
    assert back.streams_moved >= 1 and back.epoch == 2
    assert pools(cluster) == (["prefill-0", "prefill-1"], ["decode-0"])
    wait_until(blocks_free(channel), 30, "every KV block to be freed after the flips")

    # Served by the flipped workers in their new roles, still exact (the four streams at once, as
    # during the flips).
    assert greedy_streams(channel, PROMPTS, 48, timeout_s=180) == want
    counted = role_changes(cluster)
    assert counted.get(("prefill", "decode")) == 1 and counted.get(("decode", "prefill")) == 1

    loop_thread.run(cluster.flush_traces())
    wait_until(lambda: sum(s.name == "pdserve.role_flip" for s in receiver.spans()) >= 2, 30, "the flips' spans")
    flips = [s for s in receiver.spans() if s.name == "pdserve.role_flip"]
    assert {(s.attributes["pdserve.from"], s.attributes["pdserve.to"]) for s in flips} == {
        ("prefill", "decode"), ("decode", "prefill")
    }


def test_refused_flips_name_the_field_and_change_nothing(loop_thread, cluster):
    before = pools(cluster)
    with pytest.raises(FlipRefused, match="worker_id"):
        loop_thread.run(cluster.flipper.change("decode-0", "prefill"))  # the last decode worker
    with pytest.raises(FlipRefused, match="worker_id"):
        loop_thread.run(cluster.flipper.change("nobody", "decode"))
    with pytest.raises(FlipRefused, match="role"):
        loop_thread.run(cluster.flipper.change("prefill-0", "prefill"))
    with pytest.raises(FlipRefused, match="role"):
        loop_thread.run(cluster.flipper.change("prefill-0", "router"))
    assert pools(cluster) == before


def test_one_flip_at_a_time(loop_thread, cluster):
    async def two() -> tuple[Any, BaseException | None]:
        import asyncio

        first = asyncio.ensure_future(cluster.flipper.change("prefill-1", "decode"))
        await asyncio.sleep(0)  # the first holds the flip lock now
        try:
            await cluster.flipper.change("prefill-0", "decode")
            second = None
        except FlipInFlight as exc:
            second = exc
        return await first, second

    change, refused = loop_thread.run(two())
    assert change.ok and refused is not None
    back = loop_thread.run(cluster.flipper.change("prefill-1", "prefill"))
    assert back.ok
