"""Which nodes host which pool, and the one line when a pool cannot be hosted (pure policy)."""

from __future__ import annotations

import pytest

from pdserve.cluster.node_pools import (
    POOL_SHARE,
    NodeOffer,
    actor_resources,
    nodes_from_ray,
    pool_resource,
    unplaceable,
)


def node(address: str, gpus: float = 0, pools: tuple[str, ...] = ()) -> NodeOffer:
    return NodeOffer(address, gpus, frozenset(pools))


def test_nodes_from_ray_reads_pool_resources_of_alive_nodes():
    offers = nodes_from_ray([
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8, "pdserve_prefill": 1}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 4, "pdserve_prefill": 4,
                                                                          "pdserve_decode": 4}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"pdserve_decode": 1}},
    ])
    assert offers == [node("10.0.0.1", 0, ("prefill",)), node("10.0.0.2", 4, ("prefill", "decode"))]


def test_an_unlabelled_cluster_places_anywhere():
    nodes = [node("a", 2), node("b", 2)]
    assert actor_resources("prefill", nodes) == {}
    assert unplaceable(nodes, {"prefill": 2, "decode": 2}, 1) is None


def test_a_labelled_cluster_asks_for_the_pool_resource():
    nodes = [node("a", pools=("prefill",)), node("b", pools=("decode",))]
    assert actor_resources("prefill", nodes) == {"pdserve_prefill": POOL_SHARE}
    assert actor_resources("decode", nodes) == {"pdserve_decode": POOL_SHARE}
    assert unplaceable(nodes, {"prefill": 3, "decode": 3}, 0) is None


def test_a_pool_no_node_offers_is_named_with_the_command_that_adds_one():
    msg = unplaceable([node("10.0.0.1", pools=("prefill",)), node("10.0.0.9")], {"prefill": 1, "decode": 1}, 0)
    assert msg is not None and "\n" not in msg
    assert msg.startswith("no Ray node offers the decode pool (resource pdserve_decode)")
    assert "launch.sh worker --pool decode" in msg and "10.0.0.1 (prefill)" in msg and "10.0.0.9 (no pool)" in msg


def test_a_colocated_cluster_needs_no_prefill_node():
    assert unplaceable([node("a", pools=("decode",))], {"prefill": 0, "decode": 2}, 0) is None


def test_too_few_gpus_in_a_pool_are_counted():
    nodes = [node("a", 1, ("prefill",)), node("b", 4, ("decode",))]
    assert unplaceable(nodes, {"prefill": 2, "decode": 1}, 1) == (
        "2 prefill workers need 2 GPUs; the nodes offering the prefill pool have 1"
    )
    assert unplaceable([node("a", 1)], {"prefill": 1, "decode": 1}, 1) == (
        "2 workers need 2 GPUs; the pools' nodes have 1 in all"
    )


def test_nodes_of_both_pools_share_their_gpus():
    nodes = [node("a", 2, ("prefill", "decode"))]
    assert unplaceable(nodes, {"prefill": 1, "decode": 1}, 1) is None
    assert unplaceable(nodes, {"prefill": 2, "decode": 1}, 1) == "3 workers need 3 GPUs; the pools' nodes have 2 in all"


def test_only_the_two_pools_have_a_resource():
    assert pool_resource("decode") == "pdserve_decode"
    with pytest.raises(ValueError, match="pool: 'router'"):
        pool_resource("router")


def test_status_shows_each_nodes_pools_and_where_each_worker_runs():
    from pdserve.cluster.status import format_status

    nodes = [
        {"node_id": "b" * 56, "node_ip": "10.0.0.2", "is_head_node": False, "state": "ALIVE",
         "resources_total": {"CPU": 16, "GPU": 2, "pdserve_decode": 2}},
        {"node_id": "a" * 56, "node_ip": "10.0.0.1", "is_head_node": True, "state": "ALIVE",
         "resources_total": {"CPU": 16, "GPU": 1, "pdserve_prefill": 1, "pdserve_decode": 1}},
    ]
    actors = [
        {"name": "pdserve-decode-0", "state": "ALIVE", "node_id": "b" * 56, "ray_namespace": "pdserve"},
        {"name": "pdserve-prefill-0", "state": "PENDING_CREATION", "node_id": None, "ray_namespace": "pdserve"},
        {"name": "other", "state": "ALIVE", "node_id": "a" * 56, "ray_namespace": "someone-else"},
    ]
    assert format_status(nodes, actors).splitlines() == [
        "nodes:",
        "  head 10.0.0.1        alive pool prefill+decode CPU 16  GPU 1  id aaaaaaaaaaaa",
        "  node 10.0.0.2        alive pool decode         CPU 16  GPU 2  id bbbbbbbbbbbb",
        "workers:",
        "  pdserve-decode-0     ALIVE            on 10.0.0.2",
        "  pdserve-prefill-0    PENDING_CREATION on not placed",
    ]
