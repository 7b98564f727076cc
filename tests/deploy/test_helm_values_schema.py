"""values.schema.json: each rule turns a wrong value into an install-time error naming the value.

Rendering runs the same schema check as `helm install`; a case here is one rule of the schema."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from helm_objects import NAMESPACE

pytestmark = pytest.mark.deploy

HUB = {"source": "hub", "hubId": "Qwen/Qwen2.5-1.5B-Instruct", "cache": {"claimName": "cache"}}

# id -> (values, what the error must name)
REJECTED: dict[str, tuple[dict[str, Any], str]] = {
    "unknown top-level key": ({"prefil": {"replicas": 2}}, "additional properties 'prefil'"),
    "unknown pool key": ({"prefill": {"replica": 2}}, "'/prefill': additional properties 'replica'"),
    "router replicas 0": ({"router": {"replicas": 0}}, "/router/replicas"),
    "router replicas as a string": ({"router": {"replicas": "3"}}, "/router/replicas"),
    "replica extra arg with a single quote": ({"router": {"replicaExtraArgs": ["it's"]}}, "/router/replicaExtraArgs/0"),
    "ray auth secret not a DNS name": ({"rayAuth": {"secretName": "Ray_Token"}}, "/rayAuth/secretName"),
    "ray auth empty key": ({"rayAuth": {"secretName": "ray", "key": ""}}, "/rayAuth/key"),
    "router gpus above 1": ({"router": {"gpus": 2}}, "/router/gpus"),
    "negative prefill replicas": ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
    "no decode pod": ({"decode": {"replicas": 0}}, "/decode/replicas"),
    "pool without gpu": ({"decode": {"gpus": 0}}, "/decode/gpus"),
    "fractional gpus": ({"prefill": {"gpus": 1.5}}, "/prefill/gpus"),
    "gpus as a string": ({"prefill": {"gpus": "2"}}, "/prefill/gpus"),
    "cpu not a quantity": ({"decode": {"cpu": "eight"}}, "/decode/cpu"),
    "memory not a quantity": ({"prefill": {"memory": "64 gigs"}}, "/prefill/memory"),
    "shm size not a quantity": ({"shm": {"size": "lots"}}, "/shm/size"),
    "unknown model source": ({"model": {"source": "s3"}}, "/model/source"),
    "pvc source without claim": ({"model": {"source": "pvc", "path": "m"}}, "/model"),
    "pvc source without path": ({"model": {"source": "pvc", "claimName": "models"}}, "/model"),
    "gguf source not a .gguf": (
        {"model": {"source": "gguf", "claimName": "m", "path": "x.bin", "cache": {"claimName": "c"}}},
        "/model/path",
    ),
    "gguf source without cache": (
        {"model": {"source": "gguf", "claimName": "m", "path": "x.gguf"}},
        "/model/cache/claimName",
    ),
    "hub source without cache": ({"model": {"source": "hub", "hubId": "a/b"}}, "/model/cache/claimName"),
    "hub source without id": ({"model": {**HUB, "hubId": ""}}, "/model/hubId"),
    "hub id malformed": ({"model": {**HUB, "hubId": "not a hub id"}}, "/model/hubId"),
    "claim name not a DNS name": (
        {"model": {"source": "pvc", "claimName": "My_Models", "path": "m"}},
        "/model/claimName",
    ),
    "unknown dtype": ({"model": {"dtype": "fp8"}}, "/model/dtype"),
    "negative max model len": ({"model": {"maxModelLen": -1}}, "/model/maxModelLen"),
    "rdma resource name malformed": ({"rdma": {"enabled": True, "resourceName": "rdma"}}, "/rdma/resourceName"),
    "rdma count 0": ({"rdma": {"enabled": True, "count": 0}}, "/rdma/count"),
    "gpu resource name malformed": ({"gpuResourceName": "gpu"}, "/gpuResourceName"),
    "ucx tls malformed": ({"kv": {"ucxTls": "rc; rm -rf"}}, "/kv/ucxTls"),
    "kv env on all interfaces": ({"kv": {"extraEnv": [{"name": "UCX_X", "value": "0.0.0.0"}]}}, "/kv/extraEnv/0/value"),
    "kv env name malformed": ({"kv": {"extraEnv": [{"name": "1X", "value": "a"}]}}, "/kv/extraEnv/0/name"),
    "tls on without secret": ({"tls": {"enabled": True}}, "/tls/secretName"),
    "controller on without ttft slo": ({"controller": {"enabled": True, "sloItlMs": 40}}, "/controller/sloTtftMs"),
    "controller on without itl slo": ({"controller": {"enabled": True, "sloTtftMs": 300}}, "/controller/sloItlMs"),
    "otel endpoint not host:port": ({"otel": {"endpoint": "http://collector:4317/v1/traces"}}, "/otel/endpoint"),
    "otel sample ratio above 1": ({"otel": {"sampleRatio": 1.5}}, "/otel/sampleRatio"),
    "port out of range": ({"router": {"ports": {"grpc": 70000}}}, "/router/ports/grpc"),
    "unknown placement policy": ({"router": {"placementPolicy": "random"}}, "/router/placementPolicy"),
    "extra arg with a single quote": ({"router": {"extraArgs": ["it's"]}}, "/router/extraArgs/0"),
    "unknown service type": ({"router": {"service": {"type": "Ingress"}}}, "/router/service/type"),
    "empty image repository": ({"image": {"repository": ""}}, "/image/repository"),
    "unknown pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "ray version malformed": ({"rayVersion": "latest"}, "/rayVersion"),
    "pdb max unavailable 0": ({"podDisruptionBudget": {"maxUnavailable": 0}}, "/podDisruptionBudget/maxUnavailable"),
    "scrape interval malformed": (
        {"serviceMonitor": {"enabled": True, "interval": "often"}},
        "/serviceMonitor/interval",
    ),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_rejected(chart: helm.Chart, case: str) -> None:
    values, names = REJECTED[case]
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values=values, name="demo", namespace=NAMESPACE)
    assert names in str(err.value)


def test_router_ports_must_differ(chart: helm.Chart) -> None:
    """Not expressible in the schema: the template refuses it with a message."""
    with pytest.raises(helm.HelmRenderError, match="grpc, http and metrics must be three different ports"):
        chart.render(values={"router": {"ports": {"http": 50051}}}, name="demo", namespace=NAMESPACE)


ACCEPTED: dict[str, dict[str, Any]] = {
    "defaults": {},
    "colocated": {"prefill": {"replicas": 0}},
    "cpu as a number": {"prefill": {"cpu": 8}},
    "millicores": {"head": {"cpu": "500m"}},
    "hub with cache": {"model": HUB},
    "controller with slos": {"controller": {"enabled": True, "sloTtftMs": 250.5, "sloItlMs": 30}},
    "ucx tls pinned": {"kv": {"ucxTls": "rc,cuda_copy,^tcp"}},
    "router gpu off": {"router": {"gpus": 0}},
    "three routers": {"router": {"replicas": 3}},
    "ray token": {"rayAuth": {"secretName": "pdserve-ray"}},
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_accepted(chart: helm.Chart, case: str) -> None:
    """The rules above are no wider than meant: these renders go through."""
    assert chart.render(values=ACCEPTED[case], name="demo", namespace=NAMESPACE)
