"""`Cluster.start` on a real Ray instance whose one node declares 2 GPUs (Ray takes the count as
given; no GPU is used): pools whose widths need more GPUs than that, or more on one node, are
refused with one line naming the width's flag before any worker actor starts. Run in a process
of its own so that the declared GPUs do not leak into other tests' Ray instance."""

from __future__ import annotations

import json
import subprocess
import sys

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
