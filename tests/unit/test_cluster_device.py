"""A router that joins a Ray cluster takes its workers' device from the cluster's nodes, so its own
process (and pod) needs no GPU: `cluster_device` never looks at this process's CUDA."""

from __future__ import annotations

import pytest

from pdserve.cluster.node_pools import NodeOffer, cluster_device, unplaceable

GPU_NODE = NodeOffer("10.0.0.2", 8.0, frozenset({"decode"}))
CPU_NODE = NodeOffer("10.0.0.3", 0.0, frozenset())


def test_auto_follows_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def no_cuda_here() -> bool:
        raise AssertionError("the router process must not look up CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda_here)
    assert cluster_device("auto", [CPU_NODE, GPU_NODE]) == "cuda"
    assert cluster_device("auto", [CPU_NODE]) == "cpu"
    assert cluster_device("auto", []) == "cpu"
    assert cluster_device("cuda", [CPU_NODE]) == "cuda"  # asked for: kept, and refused by placement below
    assert cluster_device("cuda:1", [GPU_NODE]) == "cuda:1"
    assert cluster_device("cpu", [GPU_NODE]) == "cpu"


def test_cuda_without_gpu_nodes_is_refused_by_placement() -> None:
    problem = unplaceable([CPU_NODE], {"prefill": 0, "decode": 2}, 1)
    assert problem is not None and "need 2 GPUs" in problem


def test_bad_device_names_the_field() -> None:
    with pytest.raises(ValueError, match="device: must be auto, cpu or cuda"):
        cluster_device("tpu", [GPU_NODE])
