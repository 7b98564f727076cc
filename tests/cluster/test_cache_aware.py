"""Cache-aware placement on a real local cluster: 2 prefill + 1 decode Ray actors with the
default model, KV events flowing from the workers' prefix caches to the router's index.
Requests that repeat a prefix land on the prefill worker holding it (cached tokens in `usage`);
when that worker is busy they spread to the other one; a worker joins and drains without a
restart."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.engine.hashing import block_hashes
from pdserve.router.placement.ring import ring_key
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

BLOCK = 16


@pytest.fixture(scope="module")
def cluster(two_prefill_cluster):
    # Shared with test_role_flip (tests/cluster/conftest.py), which runs after this module: the
    # worker added here is removed again, and the placement counts below are deltas.
    return two_prefill_cluster


def placement(loop_thread, cluster) -> dict:
    async def read() -> dict:
        return cluster.router.placement_stats()

    return loop_thread.run(read())


def placed(loop_thread, cluster) -> dict[str, int]:
    return dict(placement(loop_thread, cluster)["prefill"]["placed"])


def holders(loop_thread, cluster, ids: list[int]) -> dict[str, int]:
    async def read() -> dict[str, int]:
        return cluster.router.prefill_policy.index.match(block_hashes(ids, BLOCK))

    return loop_thread.run(read())


def generate(channel, ids: list[int], max_tokens: int = 2) -> pb.GenerateResponse:
    stub = pbg.InferenceStub(channel)
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params), timeout=120))[-1]


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {w: n - before.get(w, 0) for w, n in after.items() if n - before.get(w, 0)}


def test_repeated_prefix_lands_on_the_worker_holding_it(loop_thread, cluster, channel, wait_until, blocks_free):
    base = list(range(2000, 2000 + 10 * BLOCK))
    before = placed(loop_thread, cluster)
    first = generate(channel, base + [1, 2, 3])
    assert first.usage.cached_prompt_tokens == 0
    (holder,) = delta(placed(loop_thread, cluster), before)
    wait_until(lambda: holders(loop_thread, cluster, base).get(holder) == 10, 15, "the router's index to learn the prefix")
    before = placed(loop_thread, cluster)
    for k in range(4):
        last = generate(channel, base + [10 + k, 20 + k])
        assert last.usage.cached_prompt_tokens == 10 * BLOCK
    assert delta(placed(loop_thread, cluster), before) == {holder: 4}
    stats = placement(loop_thread, cluster)["prefill"]
    assert stats["cached_tokens"] >= 4 * 10 * BLOCK and stats["predicted_cached_tokens"] >= 4 * 10 * BLOCK
    # The same figures through the public stats call.
    admin = pbg.AdminStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    prefill_stats = next(p for p in admin.placement if p.pool == "prefill")
    assert prefill_stats.cached_tokens >= 4 * 10 * BLOCK and 0 < prefill_stats.hit_rate <= 1
    assert prefill_stats.placed[holder] >= 5 and set(prefill_stats.load) >= {holder}
    wait_until(blocks_free(channel), 15, "every KV block to be freed")


def test_requests_spread_when_the_holder_is_busy(loop_thread, cluster, channel, wait_until, blocks_free):
    base = list(range(5000, 5000 + 12 * BLOCK))
    generate(channel, base + [7])
    (holder,) = holders(loop_thread, cluster, base) or {None: 0}
    wait_until(lambda: holders(loop_thread, cluster, base).get(holder) == 12, 15, "the router's index to learn the prefix")
    before = placed(loop_thread, cluster)
    # Each prompt: the shared prefix and its own 96 tokens, all at once.
    prompts = [base + list(range(9000 + 100 * i, 9000 + 100 * i + 96)) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda ids: generate(channel, ids), prompts))
    spread = delta(placed(loop_thread, cluster), before)
    assert sum(spread.values()) == 8 and len(spread) == 2, spread  # both workers took some
    assert spread[holder] > 8 - spread[holder], spread  # most still went where the prefix is
    assert all(r.finish_reason == "length" for r in results)
    assert sum(r.usage.cached_prompt_tokens == 12 * BLOCK for r in results) >= spread[holder]
    wait_until(blocks_free(channel), 15, "every KV block to be freed")


def test_a_prefill_worker_joins_and_drains_without_a_restart(loop_thread, cluster, channel, wait_until, blocks_free):
    new = loop_thread.run(cluster.add_worker("prefill"))
    assert new == "prefill-2" and new in cluster.router.prefill_policy.workers
    ring = cluster.router.prefill_policy.ring
    key_blocks = cluster.router.config.placement.prefix_blocks
    # A prompt whose ring key the newcomer owns goes there (nobody holds it yet).
    ids = next(
        p for i in range(1000)
        if ring.owner(ring_key(block_hashes(p := list(range(20000 + 50 * i, 20000 + 50 * i + 48)), BLOCK), key_blocks)) == new
    )
    before = placed(loop_thread, cluster)
    assert generate(channel, ids).finish_reason == "length"
    assert delta(placed(loop_thread, cluster), before) == {new: 1}
    assert loop_thread.run(cluster.remove_worker(new, drain_timeout_s=30)) is True
    assert new not in cluster.router.prefill_policy.workers and new not in cluster.router.prefills
    before = placed(loop_thread, cluster)
    assert generate(channel, ids).finish_reason == "length"  # its keys went back to the others
    assert new not in delta(placed(loop_thread, cluster), before)
    assert placement(loop_thread, cluster)["prefill"]["membership_changes"] == 2
    wait_until(blocks_free(channel), 15, "every KV block to be freed")
