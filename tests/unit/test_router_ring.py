"""Consistent-hash ring: ownership, clockwise walks, and what membership changes move."""

from __future__ import annotations

import random
import zlib

import pytest

from pdserve.router.placement.ring import HashRing


def keys(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(n)]


def test_ownership_does_not_depend_on_join_order():
    names = [f"prefill-{i}" for i in range(6)]
    a = HashRing(names, vnodes=32)
    b = HashRing(reversed(names), vnodes=32)
    assert all(a.owner(k) == b.owner(k) for k in keys(2000, 1))


def test_walk_visits_every_worker_once_owner_first():
    ring = HashRing([f"w{i}" for i in range(5)], vnodes=16)
    for k in keys(200, 2):
        order = list(ring.walk(k))
        assert order[0] == ring.owner(k)
        assert sorted(order) == sorted(ring.workers)


def test_empty_ring_has_no_owner():
    ring = HashRing(vnodes=4)
    assert ring.owner(123) is None and list(ring.walk(123)) == []
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(vnodes=0)


def test_a_ninth_worker_takes_about_one_ninth_of_the_keys_and_only_moves_keys_to_itself(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    ks = keys(20000, seed)
    ring = HashRing([f"w{i}" for i in range(8)], vnodes=256)
    before = {k: ring.owner(k) for k in ks}
    ring.add("w8")
    moved = [k for k in ks if ring.owner(k) != before[k]]
    assert all(ring.owner(k) == "w8" for k in moved), f"seed {seed}: a key moved between old workers"
    assert len(moved) / len(ks) <= 1 / 9 + 0.05, f"seed {seed}"


def test_removing_a_worker_moves_only_its_keys(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    ks = keys(20000, seed)
    ring = HashRing([f"w{i}" for i in range(8)], vnodes=256)
    before = {k: ring.owner(k) for k in ks}
    ring.remove("w3")
    assert "w3" not in ring and len(ring) == 7
    for k in ks:
        if before[k] != "w3":
            assert ring.owner(k) == before[k], f"seed {seed}"
        else:
            assert ring.owner(k) != "w3"


def test_256_virtual_nodes_keep_every_share_of_the_key_space_near_the_mean():
    ring = HashRing([f"prefill-{i}" for i in range(8)], vnodes=256)
    pts, owners = ring._points, ring._owners
    share = dict.fromkeys(ring.workers, 0)
    for i, p in enumerate(pts):
        share[owners[i]] += p - (pts[i - 1] if i else pts[-1] - 2**63)
    assert max(share.values()) / (2**63 / 8) < 1.15
