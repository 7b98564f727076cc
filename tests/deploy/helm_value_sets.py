"""The chart's value sets under test (each rendered, linted and validated by test_helm_chart.py,
and reused by the pod-spec and lifecycle tests) and helpers that read pods out of a render."""

from __future__ import annotations

from typing import Any

from helm_objects import by_kind, one

# Each pod-spec escape hatch, as a user would set it for RoCE over a secondary network, the
# NVIDIA runtime class and a non-root pod.
POD_HATCHES: dict[str, Any] = {
    "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "roce-net"},
    "podLabels": {"team": "inference", "app.kubernetes.io/component": "not-this"},
    "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    "runtimeClassName": "nvidia",
    "serviceAccountName": "pdserve",
    "priorityClassName": "inference-high",
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
         "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}
    ],
    "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"},
                 {"name": "SITE_TOKEN", "valueFrom": {"secretKeyRef": {"name": "site", "key": "token"}}}],
    "extraVolumes": [{"name": "site-config", "configMap": {"name": "site-config"}}],
    "extraVolumeMounts": [{"name": "site-config", "mountPath": "/etc/site", "readOnly": True}],
    "initContainers": [{"name": "wait-for-fabric", "image": "busybox:1.36", "command": ["sh", "-c", "true"]}],
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "multi_gpu": {
        "prefill": {
            "replicas": 2,
            "gpus": 4,
            "cpu": "32",
            "memory": "256Gi",
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "prefill"}},
                            },
                        }
                    ]
                }
            },
        },
        "decode": {"replicas": 3, "gpus": 8, "cpu": "64", "memory": "512Gi"},
        "model": {
            "source": "pvc",
            "claimName": "models",
            "path": "llama-3.1-8b-instruct",
            "maxModelLen": 8192,
            "dtype": "bfloat16",
        },
        "shm": {"size": "64Gi"},
    },
    "rdma": {
        "rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a", "count": 2},
        "kv": {"ucxNetDevices": "mlx5_0:1", "extraEnv": [{"name": "UCX_IB_GID_INDEX", "value": "3"}]},
        "model": {
            "source": "gguf",
            "claimName": "models",
            "path": "llama-3.2-1b.Q8_0.gguf",
            "cache": {"claimName": "pdserve-cache"},
        },
    },
    "tls": {
        "tls": {"enabled": True, "secretName": "pdserve-tls", "clientCA": True},
        "apiKeys": {"secretName": "pdserve-keys", "adminSecretName": "pdserve-admin"},
        "otel": {"endpoint": "otel-collector.observability:4317", "sampleRatio": 0.1},
        "router": {"service": {"type": "LoadBalancer"}},
        "networkPolicy": {"routerFrom": [{"namespaceSelector": {"matchLabels": {"name": "clients"}}}]},
    },
    "controller": {
        "controller": {"enabled": True, "sloTtftMs": 300, "sloItlMs": 40},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "grafanaDashboard": {"enabled": True},
        "model": {
            "source": "hub",
            "hubId": "Qwen/Qwen2.5-1.5B-Instruct",
            "cache": {"claimName": "pdserve-cache"},
            "hubTokenSecret": {"name": "hf", "key": "token"},
        },
    },
    "routers": {
        "router": {
            "replicas": 3,
            "extraArgs": ["--max-num-seqs", "128"],
            "replicaExtraArgs": ["--max-queued-requests", "256"],
        },
        "rayAuth": {"secretName": "pdserve-ray"},
        "tls": {"enabled": True, "secretName": "pdserve-tls"},
        "apiKeys": {"secretName": "pdserve-keys", "adminSecretName": "pdserve-admin"},
        "otel": {"endpoint": "otel-collector.observability:4317"},
        "model": {"source": "pvc", "claimName": "models", "path": "llama-3.1-8b-instruct"},
    },
    # Every escape hatch on every pod, keys from Secrets, an image by digest (test_helm_pod_spec.py).
    "pod_spec": {
        "image": {"repository": "registry.example.com:5000/ml/pdserve", "digest": "sha256:" + "ab" * 32},
        **{comp: POD_HATCHES for comp in ("head", "prefill", "decode")},
        "router": {"replicas": 2, **POD_HATCHES},
        "apiKeys": {"secretName": "pdserve-keys", "dataSecretName": "pdserve-data", "adminSecretName": "pdserve-admin"},
        "kv": {"ipcLock": False},
    },
    # KubeRay's lifecycle options (test_helm_lifecycle.py).
    "lifecycle": {
        "upgradeStrategy": "Recreate",
        "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis.pdserve-system:6379",
                              "passwordSecret": {"name": "redis", "key": "password"}},
        "autoscaling": {"enabled": True, "idleTimeoutSeconds": 300, "upscalingMode": "Conservative"},
        "prefill": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
        "decode": {"replicas": 4, "maxReplicas": 8},
        "controller": {"enabled": True, "sloTtftMs": 300, "sloItlMs": 40, "maxWorkers": 12},
        "router": {"probes": {"timeoutSeconds": 3, "startupFailureThreshold": 60, "periodSeconds": 15},
                   "progressDeadlineSeconds": 1000},
    },
    # Tensor-parallel pools of different widths (test_helm_tensor_parallel.py): prefill TP2 with one
    # worker a pod, decode TP1; and prefill TP1, decode TP2 with two workers in each 4-GPU pod.
    "tp_2_1": {"prefill": {"tensorParallelSize": 2}, "decode": {"replicas": 2, "tensorParallelSize": 1}},
    "tp_1_2": {"prefill": {"replicas": 2}, "decode": {"replicas": 3, "tensorParallelSize": 2, "gpus": 4}},
    "colocated": {
        "prefill": {"replicas": 0},
        "decode": {"replicas": 2, "gpus": 2},
        "podDisruptionBudget": {"enabled": False},
        "networkPolicy": {"enabled": False},
    },
}


def pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> pod spec, for the router and each Ray group."""
    rc = one(objects, "RayCluster")
    specs = {"ray-head": rc["spec"]["headGroupSpec"]["template"]["spec"]}
    for g in rc["spec"].get("workerGroupSpecs", []):
        specs[g["groupName"]] = g["template"]["spec"]
    specs["router"] = one(objects, "Deployment", "-router")["spec"]["template"]["spec"]
    for dep in by_kind(objects, "Deployment"):
        if dep["metadata"]["name"].endswith("-router-replica"):
            specs["router-replica"] = dep["spec"]["template"]["spec"]
    return specs


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
