"""The scaler counts free GPUs per node: a worker of width N needs N free GPUs on one node (its
ranks share a node), and a labelled cluster's worker a node offering its pool's resource. Pure
policy over made-up node inventories, and the scaler's adds over them (no Ray)."""

from __future__ import annotations

import asyncio

from pdserve.cluster.scaler import WorkerScaler, gpu_room
from pdserve.control.signals import Role
from pdserve.control.widths import node_for
from tests.unit.scaler_hosts import RecordingHosts


def test_gpus_free_on_two_nodes_do_not_make_one_worker():
    free = {"a": {"GPU": 1.0}, "b": {"GPU": 1.0}}
    assert node_for(free, 1) == "a" and node_for(free, 2) is None
    node, why = gpu_room(free, 2)
    assert node is None and why == "no Ray node has 2 free GPUs for one worker (2 free GPUs in all, 1, 1 by node)"
    assert gpu_room({"a": {"GPU": 1.0}, "b": {"GPU": 2.0}}, 2) == ("b", None)


def test_the_fullest_node_that_fits_is_taken():
    # A width-2 worker goes to the node with 3 free, keeping the 8-GPU node whole for a wide one.
    free = {"big": {"GPU": 8.0}, "part": {"GPU": 3.0}, "small": {"GPU": 1.0}}
    assert node_for(free, 2) == "part" and node_for(free, 4) == "big" and node_for(free, 9) is None


def test_a_labelled_pools_worker_needs_a_node_offering_its_resource():
    free = {"p": {"GPU": 4.0, "pdserve_prefill": 0.998}, "d": {"GPU": 1.0, "pdserve_decode": 0.999}}
    assert node_for(free, 2, "pdserve_prefill") == "p"
    assert node_for(free, 2, "pdserve_decode") is None  # the prefill node's GPUs are not the decode pool's
    _, why = gpu_room(free, 2, "pdserve_decode")
    assert why == "no Ray node offering pdserve_decode has 2 free GPUs for one worker (1 free GPUs in all, 1 by node)"


def _adds(free: dict, counts: dict, widths: dict, labelled: bool = False) -> tuple[list[str], str | None]:
    async def run() -> tuple[list[str], str | None]:
        scaler = WorkerScaler(None, RecordingHosts(), gpu=True, cpus_per_worker=0,  # type: ignore[arg-type]
                              free_per_node=lambda: free, widths=widths, labelled=labelled)  # fmt: skip
        out = scaler.add(counts)
        await asyncio.wait_for(asyncio.gather(*scaler._tasks), 5)
        return out

    return asyncio.run(run())


def test_the_scaler_takes_each_add_off_its_node():
    # 3 + 3 free GPUs: two TP2 workers fit (one a node), a third does not although 2 GPUs are free.
    free = {"a": {"GPU": 3.0}, "b": {"GPU": 3.0}}
    started, why = _adds(free, {Role.DECODE: 3}, {"decode": 2})
    assert started == ["decode", "decode"]
    assert why == "no Ray node has 2 free GPUs for one worker (2 free GPUs in all, 1, 1 by node)"
    # TP1 prefill workers fill the leftover single GPUs.
    started, why = _adds(free, {Role.DECODE: 2, Role.PREFILL: 2}, {"decode": 2, "prefill": 1})
    assert started == ["decode", "decode", "prefill", "prefill"] and why is None
    assert free == {"a": {"GPU": 3.0}, "b": {"GPU": 3.0}}  # Ray's answer is not written to


def test_a_labelled_cluster_adds_only_on_its_pools_nodes():
    free = {"p": {"GPU": 4.0, "pdserve_prefill": 1.0}, "d": {"GPU": 1.0, "pdserve_decode": 1.0}}
    started, why = _adds(free, {Role.DECODE: 1}, {"decode": 2}, labelled=True)
    assert started == [] and why is not None and "offering pdserve_decode" in why
    assert _adds(free, {Role.DECODE: 1}, {"decode": 2}, labelled=False)[0] == ["decode"]
