"""`pdserve serve --address` on a Ray cluster it joins: the workers' device comes from the cluster's
nodes, and the router process never asks CUDA (here, asking it fails the test), so a router pod
needs no GPU. A local Ray cluster of CPU nodes (the tests' shared instance, tests/cluster/
shared_ray.py) stands in for the joined one: `auto` is cpu there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster


@pytest.fixture
def joined(loop_thread: Any, ray_instance: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import ray
    import torch

    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    def no_cuda_here() -> bool:
        raise AssertionError("the router process looked up CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda_here)  # this process only, not the workers
    cfg = ServeConfig(device="auto", dtype="float32", port=0, engine=EngineArgs(num_kv_blocks=128),
                      ray_address=ray.get_runtime_context().gcs_address)
    cluster = loop_thread.run(Cluster.start(cfg))
    try:
        yield cluster
    finally:
        ray_instance.stop(cluster)


def test_joined_serve_takes_the_device_from_the_cluster(joined: Any) -> None:
    import grpc

    assert joined.cfg.device == "cpu"  # no node offers a GPU
    with grpc.insecure_channel(joined.address) as channel:
        params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        req = pb.GenerateRequest(request_id="device-0", prompt="Name a planet.", sampling_params=params)
        chunks = list(pbg.InferenceStub(channel).Generate(req, timeout=120))
    assert sum(len(c.token_ids) for c in chunks) == 4
