"""A decode worker's Ray actor killed mid-stream (`ray.kill`): the stream resumes on the other
decode worker with exactly the tokens of an undisturbed run, and later requests go to the
survivor; the pool reconciler then puts a new worker in its place. (The other faults of the
failure model, with in-process workers: test_failover.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import ray

from pdserve import SamplingParams
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(loop_thread: Any, ray_instance: Any) -> Iterator[Any]:
    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    cfg = ServeConfig(device="cpu", dtype="float32", port=0, num_decode=2, engine=EngineArgs(num_kv_blocks=256))
    c = loop_thread.run(Cluster.start(cfg))
    yield c
    ray_instance.stop(c)


def test_killing_the_decode_actor_mid_stream_loses_no_token(
    cluster: Any, channel: grpc.Channel, offline: Any, greedy: Any, wait_until: Any
):
    stub = pbg.InferenceStub(channel)
    ids = list(range(500, 548))
    want = offline.generate([ids], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0].token_ids
    got: list[int] = []
    killed = None
    for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, request_id="victim",
                                                  sampling_params=greedy(48, ignore_eos=True)), timeout=300):
        got += chunk.token_ids
        if killed is None and len(got) >= 8:
            killed = cluster.router._streams["victim"].worker
            ray.kill(cluster._workers[killed][1])
    assert killed is not None
    assert got == want
    assert cluster.router.metrics.failovers.labels("stream")._value.get() == 1
    assert killed not in cluster.router.decode_policy.workers  # out of placement: down, or already replaced

    # The next requests go to the survivor.
    for i in range(3):
        ids = list(range(600 + 50 * i, 630 + 50 * i))
        want = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
        chunks = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(6, ignore_eos=True)), timeout=120))
        assert [t for c in chunks for t in c.token_ids] == want

    # The pool reconciler replaced the dead worker: the pool is back to its size.
    reconciler = cluster.control.reconciler
    wait_until(lambda: [lost for lost, _ in reconciler.replaced] == [killed] and len(cluster.router.decodes) == 2,
               60, "the dead decode worker to be replaced")
    assert killed not in cluster.router.decodes
