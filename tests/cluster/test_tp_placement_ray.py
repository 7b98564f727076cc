"""`Cluster.start` on a real Ray instance whose one node declares 2 GPUs (Ray takes the count as
given; no GPU is used): pools whose widths need more GPUs than that, or more on one node, are
refused with one line naming the width's flag before any worker actor starts. And on CPU, workers
kept running (--keep-workers) by a cluster of widths 2/1 are refused by a `serve` of widths 1/2,
naming each worker's width as its KV agent reports it, and adopted by one of widths 2/1, where a
role flip asked over Admin.SetRole is refused naming the widths and Admin.GetController says why
the controller flips nothing. Each runs in a process of its own so that its Ray instance does not
meet other tests'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

SCRIPT = r"""
import asyncio, json, logging, sys
import ray
from pdserve.cluster.actors import NAMESPACE
from pdserve.cluster.node_pools import PlacementError
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ServeConfig

ray.init(namespace=NAMESPACE, num_cpus=1, num_gpus=2, include_dashboard=False, logging_level=logging.WARNING)
address = ray.get_runtime_context().gcs_address
out = {}
for name, widths in {"p2d1": (2, 1), "p1d4": (1, 4)}.items():
    cfg = ServeConfig(device="cuda", port=0, ray_address=address, num_prefill=1, num_decode=1,
                      prefill_tensor_parallel_size=widths[0], decode_tensor_parallel_size=widths[1])
    try:
        asyncio.run(asyncio.wait_for(Cluster.start(cfg), 120))
        out[name] = "started"
    except PlacementError as exc:
        out[name] = str(exc)
out["actors"] = ray.util.list_named_actors(all_namespaces=True)
ray.shutdown()
print(json.dumps(out))
"""


def test_wide_pools_are_refused_when_the_cluster_lacks_their_gpus() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 1P (TP2) + 1D (TP1): 3 GPUs of 2.
    assert out["p2d1"] == "2 workers need 3 GPUs; the pools' nodes have 2 in all"
    # 1D (TP4): no node holds 4 GPUs.
    assert out["p1d4"].startswith("1 decode workers of 4 ranks (--decode-tensor-parallel-size 4) need 4 GPUs on one node")
    assert out["actors"] == []  # refused before any worker actor started


ADOPT = r"""
import asyncio, json, logging, sys
from dataclasses import replace
import ray
from pdserve.cluster.actors import NAMESPACE
from pdserve.cluster.node_pools import PlacementError
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ControllerSettings, ServeConfig
from pdserve.engine.args import EngineArgs
import grpc
from pdserve_proto import inference_pb2 as pb, inference_pb2_grpc as pbg

ray.init(namespace=NAMESPACE, num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
cfg = ServeConfig(model=sys.argv[1], device="cpu", dtype="float32", port=0, engine=EngineArgs(num_kv_blocks=32),
                  ray_address=ray.get_runtime_context().gcs_address, keep_workers=True, cpu_threads_per_worker=1,
                  prefill_tensor_parallel_size=2, decode_tensor_parallel_size=1)

async def main():
    out = {}
    first = await asyncio.wait_for(Cluster.start(cfg), 180)
    out["started"] = sorted(first._workers)
    await first.stop()  # --keep-workers: the workers serve on
    swapped = replace(cfg, prefill_tensor_parallel_size=1, decode_tensor_parallel_size=2)
    try:
        await asyncio.wait_for(Cluster.start(swapped), 120)
        out["swapped"] = "started"
    except PlacementError as exc:
        out["swapped"] = str(exc)
    again = await asyncio.wait_for(Cluster.start(replace(cfg, keep_workers=False, controller=ControllerSettings())), 120)
    out["adopted"] = sorted(again._workers)
    async with grpc.aio.insecure_channel(again.address) as ch:
        admin = pbg.AdminStub(ch)
        try:
            await admin.SetRole(pb.SetRoleRequest(worker_id="prefill-0", role="decode"), timeout=30)
            out["flip"] = "flipped"
        except grpc.aio.AioRpcError as exc:
            out["flip"] = [exc.code().name, exc.details()]
        state = await admin.GetController(pb.GetControllerRequest(), timeout=30)
        out["flips_refused"], out["pools"] = state.flips_refused, [state.prefill, state.decode]
    await again.stop()  # and the workers with it
    return out

out = asyncio.run(main())
out["actors"] = ray.util.list_named_actors(all_namespaces=True)
ray.shutdown()
print(json.dumps(out))
"""


def test_running_workers_of_another_width_are_refused_and_of_the_same_adopted(tmp_path: Path) -> None:
    import torch
    import transformers

    from tests.tiny_models import TINY_COMMON

    config = transformers.Qwen2Config(**TINY_COMMON)  # 2 KV heads: one a rank at width 2
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, "-c", ADOPT, str(tmp_path)], capture_output=True, text=True, timeout=420,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["started"] == ["decode-0", "prefill-0"]
    assert out["swapped"] == (
        "running workers of another width than --prefill-tensor-parallel-size 1, --decode-tensor-parallel-size 2: "
        "decode-0 (decode, 1 ranks), prefill-0 (prefill, 2 ranks); serve with their widths, or stop them first"
    )
    assert out["adopted"] == ["decode-0", "prefill-0"] and out["actors"] == []
    refusal = "the prefill pool's workers span 2 ranks and the decode pool's 1; a worker keeps its width"
    assert out["flip"][0] == "INVALID_ARGUMENT" and out["flip"][1].startswith("role: " + refusal)
    assert out["flips_refused"].startswith(refusal) and out["pools"] == [1, 1]  # nothing moved
