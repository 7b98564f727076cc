"""Placement decisions without processes: the load bound, prefill and decode choices, the
decaying load, and the policy object the router and the benchmark share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest

from pdserve.engine.hashing import block_hashes
from pdserve.router.load.recent_load import RecentLoad
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.pool_state import DecodePolicy, PrefillPolicy
from pdserve.router.placement.ring import ring_key
from pdserve.router.placement.scoring import pick_decode, pick_prefill, prefill_cost, under_bound
from pdserve.router.placement.strategies import IndexPlacement, PlacementRequest, PrefillPlacement, RingPlacement
from pdserve_proto.worker_pb2 import KvEventBatch


def test_bound_with_unit_loads_is_the_ceiling_rule():
    # load + 1 <= ceil(c * (total + 1) / n)  <=>  load < c * (total + 1) / n for integer loads
    for loads in ({"a": 2, "b": 0, "c": 0}, {"a": 3, "b": 3, "c": 1}, {"a": 0, "b": 0}):
        total, n = sum(loads.values()), len(loads)
        cap = math.ceil(1.25 * (total + 1) / n)
        expected = [w for w, x in loads.items() if x + 1 <= cap]
        assert under_bound(loads, dict.fromkeys(loads, 1), 1.25) == expected


def test_the_least_loaded_worker_is_always_under_the_bound():
    loads = {"a": 50.0, "b": 49.0, "c": 10.0}
    assert under_bound(loads, dict.fromkeys(loads, 1.0), 1.0) == ["c"]


def test_prefill_cost_never_counts_the_block_of_the_last_token_as_cached():
    assert prefill_cost(64, 4, 16) == 1  # 4 full blocks cached, but the 4th holds the last token
    assert prefill_cost(65, 4, 16) == 1  # the partial 5th block is computed
    assert prefill_cost(100, 0, 16) == 7


def test_without_a_match_the_ring_decides_among_workers_under_the_bound():
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    cost = dict.fromkeys(loads, 10.0)
    kw = dict(c=1.25, miss_weight=1.0, load_weight=0.1)
    assert pick_prefill(["b", "c", "a"], loads, loads, cost, {}, **kw) == "b"
    hot = {"a": 0.0, "b": 100.0, "c": 0.0}  # the owner is above the bound: next clockwise
    assert pick_prefill(["b", "c", "a"], hot, hot, cost, {}, **kw) == "c"


def test_a_cached_prefix_beats_the_ring_owner_unless_it_is_above_the_bound():
    kw = dict(c=1.25, miss_weight=1.0, load_weight=0.1)
    loads = {"a": 10.0, "b": 10.0, "c": 10.0}
    cost = {"a": 20.0, "b": 2.0, "c": 20.0}
    assert pick_prefill(["a", "b", "c"], loads, loads, cost, {"b": 18}, **kw) == "b"
    busy = {"a": 10.0, "b": 40.0, "c": 10.0}
    assert pick_prefill(["a", "b", "c"], busy, busy, cost, {"b": 18}, **kw) == "a"


def test_decode_prefers_the_worker_holding_most_of_the_prefix_with_room():
    loads = {"a": 1, "b": 1, "c": 1}
    room = {"a": 100, "b": 100, "c": None}
    assert pick_decode(["a", "b", "c"], loads, {"b": 5}, room, 8, c=1.25) == "b"
    assert pick_decode(["a", "b", "c"], loads, {}, room, 8, c=1.25) == "a"
    # b holds the prefix but has no room for the rest; c never reported, so it counts as roomy
    assert pick_decode(["a", "b", "c"], loads, {"b": 5, "c": 2}, {"a": 0, "b": 1, "c": None}, 8, c=1.25) == "c"
    # nobody has room: the least loaded, to answer for itself
    assert pick_decode(["a", "b"], {"a": 2, "b": 1}, {}, {"a": 0, "b": 0}, 8, c=1.25) == "b"
    # b is above the bound (4 >= 1.25 * 7 / 3): a worker with less of the prefix gets it
    assert pick_decode(["a", "b", "c"], {"a": 1, "b": 4, "c": 1}, {"b": 5, "a": 1}, room, 8, c=1.25) == "a"


def test_decode_prefers_the_worker_with_fewer_prompt_tokens_of_its_own_to_prefill():
    room = {"a": 100, "b": 100}
    # a is first listed and as loaded as b, but a new prompt there starts after a's 2,000 waiting tokens
    assert pick_decode(["a", "b"], {"a": 2, "b": 2}, {}, room, 8, c=1.25, prompt_backlog={"a": 2000.0}) == "b"
    # b has fewer requests in flight; with its prompts further behind, a gets the prompt
    backlog = {"a": 100.0, "b": 3000.0}
    assert pick_decode(["a", "b"], {"a": 3, "b": 2}, {}, room, 8, c=1.25, prompt_backlog=backlog) == "a"
    # without it, fewer requests in flight decide
    assert pick_decode(["a", "b"], {"a": 3, "b": 2}, {}, room, 8, c=1.25) == "b"
    # equal backlogs: the least loaded; the prefix still comes first
    assert pick_decode(["a", "b"], {"a": 3, "b": 2}, {}, room, 8, c=1.25, prompt_backlog={"a": 5.0, "b": 5.0}) == "b"
    assert pick_decode(["a", "b"], {"a": 2, "b": 2}, {"a": 4}, room, 8, c=1.25, prompt_backlog={"a": 2000.0}) == "a"
    # the bound still holds: a is over it (4 >= 1.25 * 5 / 2) whatever b's backlog
    assert pick_decode(["a", "b"], {"a": 4, "b": 0}, {}, room, 8, c=1.25, prompt_backlog={"b": 9000.0}) == "b"


def test_recent_load_decays_and_corrections_never_go_negative():
    r = RecentLoad(window_s=2.0)
    r.add_worker("a")
    r.add("a", 10.0, now=0.0)
    assert r.at(2.0)["a"] == pytest.approx(10 / math.e)
    r.add("a", -100.0, now=2.0)
    assert r.at(3.0)["a"] == 0.0
    assert r.decay(1.0, 3.0) == pytest.approx(math.exp(-1.0))


def test_config_rejects_nonsense_naming_the_field():
    for kw, field in ((dict(policy="nope"), "policy"), (dict(load_factor=0.9), "load_factor"),
                      (dict(prefix_blocks=0), "prefix_blocks"), (dict(vnodes=0), "vnodes")):
        with pytest.raises(ValueError, match=field):
            PlacementConfig(**kw)


def test_ring_key_names_the_leading_blocks():
    hs = block_hashes(list(range(100)), 16)
    assert ring_key(hs, 4) == hs[3] and ring_key(hs, 64) == hs[-1] and ring_key([], 4) is None


def test_prefill_policy_follows_the_index_and_learns_the_real_cost():
    policy = PrefillPolicy(PlacementConfig(), ["p0", "p1", "p2"])
    prompt = list(range(1000, 1000 + 160))
    hs = block_hashes(prompt, 16)
    first = policy.place(hs, len(prompt), now=0.0)
    assert first.worker == policy.ring.owner(ring_key(hs, 16)) and first.cost == 10
    policy.finish(first, now=0.1, cached_tokens=0)
    holder = "p1" if first.worker != "p1" else "p2"  # another worker reports holding the prompt
    assert policy.apply_events(holder, KvEventBatch(seq=1, stored=hs))
    again = policy.place(hs, len(prompt), now=0.2)
    assert again.worker == holder and again.matched_blocks == 10 and again.cost == 1
    policy.finish(again, now=0.3, cached_tokens=144)
    stats = policy.stats(now=0.3)
    assert stats.cached_tokens == 144 and stats.prompt_tokens == 320 and stats.off_home == 1
    assert stats.inflight == {"p0": 0, "p1": 0, "p2": 0}


def test_a_prompt_scored_for_its_logprobs_counts_no_cached_prefix():
    """prompt_logprobs need every prompt position's logits, so the engine takes no prefix-cache
    hits for such a prompt: placement must not send it after a copy it cannot use, nor cost it
    as if cached. Its ring key still places it (its blocks join the cache at home)."""
    policy = PrefillPolicy(PlacementConfig(), ["p0", "p1", "p2"])
    prompt = list(range(2000, 2000 + 160))
    hs = block_hashes(prompt, 16)
    home = policy.ring.owner(ring_key(hs, 16))
    holder = next(w for w in ("p0", "p1", "p2") if w != home)
    assert policy.apply_events(holder, KvEventBatch(seq=1, stored=hs))
    plain = policy.place(hs, len(prompt), now=0.0)
    assert (plain.worker, plain.matched_blocks, plain.cost) == (holder, 10, 1)
    policy.finish(plain)
    scored = policy.place(hs, len(prompt), now=0.0, reuse=False)
    assert (scored.worker, scored.matched_blocks, scored.cost) == (home, 0, 10)
    assert policy.stats(now=0.0).predicted_cached_tokens == 160  # the plain prompt's only


def test_a_scored_prompt_is_not_prefilled_on_a_decode_worker_for_a_prefix_it_cannot_use():
    policy = DecodePolicy(PlacementConfig(max_local_prefill_tokens=32), ["d0"])
    prompt = list(range(700, 700 + 120))
    hs = block_hashes(prompt, 16)
    policy.apply_events("d0", KvEventBatch(seq=1, stored=hs, num_available=100, num_blocks=100))
    p = policy.place(hs, len(prompt))
    assert p.matched_blocks == 7  # its pull is still shorter: an imported prompt takes hits
    assert policy.prefill_here(p, has_prefill_workers=True)  # 8 tokens to compute: local
    assert not policy.prefill_here(p, has_prefill_workers=True, reuse=False)  # all 120: the prefill pool's


def test_prefill_policy_refuses_only_at_hard_capacity():
    policy = PrefillPolicy(PlacementConfig(), ["p0", "p1"])
    hs = block_hashes(list(range(64)), 16)
    placed = [policy.place(hs, 64, now=0.0, capacity=2) for _ in range(4)]
    assert sorted(p.worker for p in placed) == ["p0", "p0", "p1", "p1"]
    assert policy.place(hs, 64, now=0.0, capacity=2) is None
    policy.finish(placed[0])
    assert policy.place(hs, 64, now=0.0, capacity=2).worker == placed[0].worker


def test_a_prompt_without_a_full_block_goes_to_the_least_queued_worker():
    policy = PrefillPolicy(PlacementConfig(), ["p0", "p1"])
    big = policy.place(block_hashes(list(range(320)), 16), 320, now=0.0)
    small = policy.place([], 5, now=0.0)
    assert small.worker != big.worker and small.home is None


def test_membership_changes_are_counted_with_the_share_of_keys_they_moved():
    policy = PrefillPolicy(PlacementConfig(), [f"p{i}" for i in range(8)])
    for i in range(2000):
        p = policy.place(block_hashes([i] * 16, 16), 16, now=0.0)
        policy.finish(p)
    policy.add_worker("p8")
    s = policy.stats(now=0.0)
    assert s.membership_changes == 1 and 0.05 < s.last_remap_fraction <= 1 / 9 + 0.05
    policy.remove_worker("p8")
    assert policy.stats(now=0.0).last_remap_fraction == pytest.approx(s.last_remap_fraction)
    policy.finish(p)  # finishing on a worker that left is harmless


def test_decode_policy_uses_reported_headroom_and_prefix():
    policy = DecodePolicy(PlacementConfig(), ["d0", "d1"])
    prompt = list(range(500, 500 + 80))
    hs = block_hashes(prompt, 16)
    policy.apply_events("d1", KvEventBatch(seq=1, stored=hs[:3], num_available=100, num_blocks=100))
    policy.apply_events("d0", KvEventBatch(seq=1, num_available=100, num_blocks=100))
    p = policy.place(hs, len(prompt))
    assert p.worker == "d1" and p.matched_blocks == 3
    policy.finish(p)
    policy.apply_events("d1", KvEventBatch(seq=2, num_available=0, num_blocks=100))  # d1 is full
    assert policy.place(hs, len(prompt)).worker == "d0"


def test_decode_placement_refuses_no_request_by_count_under_the_default_config():
    """A decode worker takes what its KV memory holds (its own batch limit and wait for blocks):
    the router's default bounds no count of requests in flight on it (256 once refused work while
    the workers' KV memory was largely free)."""
    from pdserve.router.router_config import RouterConfig

    cap = RouterConfig(model_id="m", max_model_len=1024, vocab_size=100).max_inflight_per_decode
    policy = DecodePolicy(PlacementConfig(), ["d0"])
    hs = block_hashes(list(range(32)), 16)
    placed = [policy.place(hs, 32, cap) for _ in range(2048)]
    assert all(p is not None and p.worker == "d0" for p in placed)


class _Last(PrefillPlacement):
    """Ranks the open workers in reverse join order: a policy the router does not ship."""

    def place(self, request: PlacementRequest) -> list[str]:
        return list(reversed(request.open))


@dataclass(frozen=True)
class _LastConfig(PlacementConfig):
    policies: ClassVar = {"last": _Last}


def test_the_policy_is_the_class_the_config_names_in_its_registry():
    assert type(PrefillPolicy(PlacementConfig(), ["a"]).placement) is IndexPlacement
    assert type(PrefillPolicy(PlacementConfig(policy="ring"), ["a"]).placement) is RingPlacement
    pool = PrefillPolicy(_LastConfig(policy="last"), ["a", "b", "c"])
    hs = block_hashes(list(range(64)), 16)
    assert [pool.place(hs, 64, now=0.0, capacity=1).worker for _ in range(3)] == ["c", "b", "a"]
    with pytest.raises(ValueError, match="^policy: 'index' is not one of last"):
        _LastConfig()


def test_a_policy_ranks_every_open_worker_best_first():
    pool = PrefillPolicy(PlacementConfig(), ["p0", "p1", "p2"])
    hs = block_hashes(list(range(160)), 16)
    key = ring_key(hs, 16)
    request = PlacementRequest(160, key, ("p0", "p1", "p2"), {w: 10.0 for w in ("p0", "p1", "p2")}, {}, None, 0.0)
    ranked = pool.placement.place(request)
    assert sorted(ranked) == ["p0", "p1", "p2"] and ranked[0] == pool.ring.owner(key)
    assert pool.place(hs, 160, now=0.0).worker == ranked[0]
