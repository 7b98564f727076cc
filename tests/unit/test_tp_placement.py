"""Workers wider than one rank on Ray, without Ray: the GPUs a worker of width N reserves, the
placement pre-check counting N GPUs of one node per worker of that pool (naming the flag), the
actor options that carry the reservation, the scaler's room check by width (Ray's free
resources given as a plain mapping), and adoption refusing running workers of another width."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster.actors import actor_options
from pdserve.cluster.adoption import Worker, ranks, width_problem
from pdserve.cluster.node_pools import NodeOffer, unplaceable, worker_gpus
from pdserve.cluster.scaler import WorkerScaler, room_for
from pdserve.cluster.serve_config import ServeConfig
from pdserve.control.signals import Role
from pdserve_proto import kv_pb2
from tests.unit.scaler_hosts import RecordingHosts


def node(address: str, gpus: float = 0, pools: tuple[str, ...] = ()) -> NodeOffer:
    return NodeOffer(address, gpus, frozenset(pools))


def test_a_worker_reserves_one_gpu_per_rank_on_cuda_and_none_on_cpu():
    assert worker_gpus("cuda", 1) == 1
    assert worker_gpus("cuda", 4) == 4
    assert worker_gpus("cuda:1", 2) == 2
    assert worker_gpus("cpu", 2) == 0
    with pytest.raises(ValueError, match="^width: "):
        worker_gpus("cuda", 0)


def test_actor_options_carry_the_gpus():
    opts = actor_options("decode-0", {"pdserve_decode": 0.001}, worker_gpus("cuda", 2))
    assert opts["num_gpus"] == 2 and opts["name"] == "pdserve-decode-0" and opts["lifetime"] == "detached"
    assert actor_options("decode-0", {}, worker_gpus("cpu", 2))["num_gpus"] == 0


def test_the_pools_width_comes_from_its_own_setting():
    cfg = ServeConfig(prefill_tensor_parallel_size=4, decode_tensor_parallel_size=2)
    assert (cfg.tensor_parallel_size("prefill"), cfg.tensor_parallel_size("decode")) == (4, 2)
    with pytest.raises(ValueError, match="^role: "):
        cfg.tensor_parallel_size("router")


def test_a_wide_pool_counts_its_width_in_gpus_and_names_the_flag():
    nodes = [node("a", 4, ("prefill",)), node("b", 2, ("decode",))]
    # 2 prefill workers of TP2 take the prefill node's 4 GPUs; 1 decode of TP2 the decode node's 2.
    assert unplaceable(nodes, {"prefill": 2, "decode": 1}, 1, {"prefill": 2, "decode": 2}) is None
    msg = unplaceable(nodes, {"prefill": 1, "decode": 2}, 1, {"prefill": 2, "decode": 2})
    assert msg == (
        "2 decode workers of 2 ranks (--decode-tensor-parallel-size 2) need 2 GPUs on one node each, 4 in all; "
        "the nodes offering the decode pool have room for 1 (GPUs per node: 2)"
    )
    # No prefill node holds a worker of TP8.
    msg = unplaceable(nodes, {"prefill": 1, "decode": 1}, 1, {"prefill": 8, "decode": 1})
    assert msg is not None and "--prefill-tensor-parallel-size 8" in msg and "need 8 GPUs on one node" in msg


def test_a_worker_does_not_span_nodes():
    # Two nodes of one GPU each have 2 GPUs, but no node holds a worker of width 2.
    nodes = [node("a", 1), node("b", 1)]
    msg = unplaceable(nodes, {"prefill": 0, "decode": 1}, 1, {"decode": 2})
    assert msg is not None and msg.endswith("the cluster has room for 0 (GPUs per node: 1, 1)")
    assert unplaceable([node("a", 2)], {"prefill": 0, "decode": 1}, 1, {"decode": 2}) is None


def test_nodes_of_both_pools_share_their_gpus_by_width():
    nodes = [node("a", 4, ("prefill", "decode"))]
    # TP2 prefill (2 GPUs) + 2 decode of TP1: 4 GPUs, all the node has.
    assert unplaceable(nodes, {"prefill": 1, "decode": 2}, 1, {"prefill": 2, "decode": 1}) is None
    # 1P (TP2) + 1D (TP4): each fits the node alone, not both together.
    assert unplaceable(nodes, {"prefill": 1, "decode": 1}, 1, {"prefill": 2, "decode": 4}) == (
        "2 workers need 6 GPUs; the pools' nodes have 4 in all"
    )


def test_cpu_workers_of_any_width_need_no_gpu():
    assert unplaceable([node("a")], {"prefill": 1, "decode": 1}, worker_gpus("cpu", 1), {"prefill": 2, "decode": 2}) is None


def test_room_for_a_wide_worker_counts_its_gpus():
    assert room_for({"GPU": 2.0}, gpu=True, cpus=0, gpus=2) is None
    assert room_for({"GPU": 1.0}, gpu=True, cpus=0, gpus=2) == "Ray has 1 free GPU for a worker needing 2"
    assert room_for({"CPU": 4.0}, gpu=False, cpus=4, gpus=2) is None  # CPU workers: their threads, not GPUs





def test_the_scaler_adds_only_what_the_free_gpus_hold_by_width():
    async def run() -> tuple[list[str], str | None, list[str]]:
        hosts = RecordingHosts()
        scaler = WorkerScaler(None, hosts, gpu=True, cpus_per_worker=0,  # type: ignore[arg-type]
                              free_per_node=lambda: {"n1": {"GPU": 5.0}}, widths={"prefill": 4, "decode": 2})  # fmt: skip
        started, why = scaler.add({Role.PREFILL: 1, Role.DECODE: 1})
        await asyncio.wait_for(asyncio.gather(*scaler._tasks), 5)
        return started, why, hosts.added

    started, why, added = asyncio.run(run())
    # The prefill worker takes 4 of the 5 free GPUs; the decode worker's 2 are not there.
    assert started == ["prefill"] and added == ["prefill"]
    assert why == "no Ray node has 2 free GPUs for one worker (1 free GPUs in all, 1 by node)"


def _worker(worker_id: str, role: str, shards: int) -> Worker:
    info = kv_pb2.KvAgentInfo(worker_id=worker_id, shards=[kv_pb2.KvShard(kv_heads=[i]) for i in range(shards)])
    return Worker(worker_id, role, actor=None, info=info)


def test_adopted_workers_must_be_of_their_pools_width():
    assert ranks(_worker("a", "decode", 0).info) == 1 and ranks(_worker("a", "decode", 2).info) == 2
    running = {"prefill-0": _worker("prefill-0", "prefill", 2), "decode-0": _worker("decode-0", "decode", 0)}
    assert width_problem(running, {"prefill": 2, "decode": 1}) is None
    # Served again with the widths swapped: both running workers are named, with their widths.
    assert width_problem(running, {"prefill": 1, "decode": 2}) == (
        "running workers of another width than --prefill-tensor-parallel-size 1, --decode-tensor-parallel-size 2: "
        "decode-0 (decode, 1 ranks), prefill-0 (prefill, 2 ranks); serve with their widths, or stop them first"
    )
