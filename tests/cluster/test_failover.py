"""The failure model: a prefill worker or a decode worker dies, before, during or after its part of
a request, and the request still completes with the tokens of an undisturbed run, or ends with a
clear UNAVAILABLE once no worker is left.

Real workers in this process (real engines, real NIXL); a worker "dies" when the test kills it in
the in-process cluster: its engine loop stops, and every later call to it fails the way a dead Ray
actor's does. The same faults with real Ray actors killed by `ray.kill` are in test_failover_ray.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.router.handles import RouterError
from pdserve.router.membership import MembershipConfig
from pdserve_proto import inference_pb2 as pb

pytestmark = pytest.mark.cluster

FAST = MembershipConfig(wait_s=0.05, min_interval_s=0.0, timeout_s=2.0, max_failures=2, retry_s=0.02)


def failovers(c: Any, stage: str) -> float:
    return c.router.metrics.registry.get_sample_value("pdserve_failovers_total", {"stage": stage}) or 0.0


def _expected(offline: LLM, ids: list[int], n: int, **kw: Any) -> list[int]:
    return offline.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, **kw))[0].token_ids


def _prompts(n: int) -> list[list[int]]:
    return [list(range(200 + 37 * i, 240 + 37 * i)) for i in range(n)]


def _start(start_in_process: Any, num_prefill: int, num_decode: int) -> Any:
    return start_in_process(
        num_prefill=num_prefill, num_decode=num_decode, serve=False,
        router_overrides={"membership": FAST, "decode_start_timeout_s": 20.0},
    )  # fmt: skip


# A pool of two for the pool whose worker dies, one worker in the other: each engine costs
# a second to build, and a test builds its cluster anew (it kills workers).
@pytest.fixture
def two_prefill(start_in_process: Any) -> Iterator[Any]:
    c = _start(start_in_process, 2, 1)
    yield c
    c.close()


@pytest.fixture
def two_decode(start_in_process: Any) -> Iterator[Any]:
    c = _start(start_in_process, 1, 2)
    yield c
    c.close()


def test_a_dead_prefill_worker_is_retried_on_another(two_prefill: Any, offline: LLM):
    c = two_prefill
    c.kill("prefill-0")
    for ids in _prompts(4):  # whichever of them the ring sends to prefill-0 moves to prefill-1
        assert c.generate(ids, pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) == _expected(offline, ids, 8, temperature=0.0)
    assert failovers(c, "prefill") >= 1
    assert "prefill-0" in c.router.placement_stats()["down"]
    assert c.prefill_workers[1].stats().pinned_requests == 0  # every handle was pulled and freed


def test_a_decode_worker_dead_before_the_pull_hands_over_to_another(two_decode: Any, offline: LLM, wait_until: Any):
    c = two_decode
    c.kill("decode-0")
    for ids in _prompts(4):
        assert c.generate(ids, pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) == _expected(offline, ids, 8, temperature=0.0)
    assert failovers(c, "handover") >= 1
    assert c.decode_workers[1].stats().transfers == 4  # the same KV handles, pulled by the survivor
    for p in c.prefill_workers:
        wait_until(lambda p=p: p.stats().pinned_requests == 0, 10, "the prefill workers' KV freed once pulled")
    wait_until(lambda: c.decode_workers[1].stats().kv_blocks_in_use == 0, 10, "the survivor's blocks freed")


RESUMED_SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.9, "seed": 1234},
    # Penalties count the tokens made before the failure too: the resumed worker rebuilds them.
    "seeded-penalties": {"temperature": 0.75, "seed": 99, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                         "repetition_penalty": 1.25, "logit_bias": {13: 2.0}},
}


@pytest.mark.parametrize("sampling", list(RESUMED_SAMPLING))
def test_a_decode_worker_dying_mid_stream_is_resumed_elsewhere(
    two_decode: Any, offline: LLM, sampling: str, wait_until: Any
):
    c = two_decode
    ids = _prompts(1)[0]
    kw = RESUMED_SAMPLING[sampling]
    want = _expected(offline, ids, 40, **kw)
    killed: list[str] = []

    def kill_after_ten(n: int) -> None:
        if n >= 10 and not killed:
            serving = next(iter(c.router.relay.streams.values())).worker
            killed.append(serving)
            c.kill(serving)

    got = c.generate(ids, pb.SamplingParams(max_tokens=40, ignore_eos=True, **kw), on_chunk=kill_after_ten)
    assert killed, "the stream ended before the test could kill its decode worker"
    assert got == want  # no token lost, none repeated, the seeded draws continue where they were
    assert failovers(c, "stream") == 1
    survivor = next(d for d in c.decode_workers if d.worker_id != killed[0])
    wait_until(lambda: survivor.stats().kv_blocks_in_use == 0, 10, "the survivor's blocks freed")


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_with_every_worker_of_a_pool_dead_the_request_ends_unavailable(
    request: pytest.FixtureRequest, pool: str, wait_until: Any
):
    c = request.getfixturevalue("two_prefill" if pool == "prefill" else "two_decode")
    for w in c.prefills if pool == "prefill" else c.decodes:
        c.kill(w.worker_id)
    with pytest.raises(RouterError) as err:
        c.generate(_prompts(1)[0], pb.SamplingParams(max_tokens=4, temperature=0.0))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message.startswith(f"{pool}:"), err.value.message
    if pool == "decode":
        for p in c.prefill_workers:  # the KV it prefilled is released, not left to its lease
            wait_until(lambda p=p: p.stats().pinned_requests == 0, 10, "the prefill worker's KV released")
