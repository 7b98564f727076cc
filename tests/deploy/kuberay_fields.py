"""The KubeRay `ray.io/v1` RayCluster fields the chart uses, with their meaning, checked strictly.

No package registry this project uses (PyPI, npm, Debian) ships KubeRay's CRD schema, so the
RayCluster is checked against this list instead (written from KubeRay's ray.io/v1 types): an unknown field, a missing required one or a
wrong type fails. The pod templates inside it are core `PodTemplateSpec`s and are validated
against the Kubernetes schemas like every other object (test_helm_chart.py).
"""

from __future__ import annotations

from typing import Any

# field -> (type, required, meaning)
SPEC: dict[str, tuple[type, bool, str]] = {
    "rayVersion": (str, False, "the Ray version in the image; KubeRay adapts its start command to it"),
    "enableInTreeAutoscaling": (bool, False, "run KubeRay's autoscaler sidecar (off: the pools are fixed)"),
    "autoscalerOptions": (dict, False, "the autoscaler's settings (KubeRay 1.0+)"),
    "upgradeStrategy": (dict, False, "what KubeRay does with running pods when their template changes (KubeRay 1.6+)"),
    "gcsFaultToleranceOptions": (dict, False, "GCS fault tolerance: the GCS's tables in an external Redis (KubeRay 1.3+)"),
    "headGroupSpec": (dict, True, "the head pod: GCS, dashboard; no pdserve worker"),
    "workerGroupSpecs": (list, False, "the worker groups, one per pool (prefill, decode)"),
}
HEAD_GROUP: dict[str, tuple[type, bool, str]] = {
    "rayStartParams": (dict, False, "`ray start` flags (string values) for the head"),
    "template": (dict, True, "the head's PodTemplateSpec"),
}
WORKER_GROUP: dict[str, tuple[type, bool, str]] = {
    "groupName": (str, True, "the group's name; KubeRay labels its pods ray.io/group=<name>"),
    "replicas": (int, False, "pods in the group"),
    "minReplicas": (int, True, "autoscaler floor (replicas unless autoscaling is on)"),
    "maxReplicas": (int, True, "autoscaler ceiling (replicas unless autoscaling is on)"),
    "rayStartParams": (dict, False, "`ray start` flags (string values) for the group's pods"),
    "template": (dict, True, "the group's PodTemplateSpec"),
}
UPGRADE_STRATEGY: dict[str, tuple[type, bool, str]] = {
    "type": (str, False, "Recreate (every pod anew at once) or None (running pods left alone)"),
}
UPGRADE_TYPES = ("Recreate", "None")
AUTOSCALER_OPTIONS: dict[str, tuple[type, bool, str]] = {
    "idleTimeoutSeconds": (int, False, "an idle worker pod goes after this long"),
    "upscalingMode": (str, False, "Default, Aggressive or Conservative"),
}
UPSCALING_MODES = ("Default", "Aggressive", "Conservative")
GCS_FT_OPTIONS: dict[str, tuple[type, bool, str]] = {
    "redisAddress": (str, False, "host:port of the external Redis"),
    "redisPassword": (dict, False, "a RedisCredential: `value` or `valueFrom` (an EnvVarSource)"),
    "externalStorageNamespace": (str, False, "the key prefix in Redis (default: the RayCluster's UID)"),
}
REDIS_CREDENTIAL: dict[str, tuple[type, bool, str]] = {
    "value": (str, False, "a literal (the chart never writes one)"),
    "valueFrom": (dict, False, "where to read it, e.g. a secretKeyRef"),
}

# rayStartParams keys the chart sets, each a `ray start` option.
RAY_START_PARAMS = {
    "node-ip-address": "the address Ray (and the KV agents' metadata exchange over Ray) uses: the pod's IP",
    "num-cpus": "CPUs offered to Ray's scheduler",
    "num-gpus": "GPUs offered to Ray's scheduler",
    "resources": "custom resources, a JSON object in the shell-quoted form KubeRay passes through",
}


def _check_fields(obj: dict[str, Any], fields: dict[str, tuple[type, bool, str]], where: str) -> list[str]:
    errors = [f"{where}.{k}: not a field the chart knows KubeRay to have" for k in obj if k not in fields]
    for name, (kind, required, _) in fields.items():
        if name not in obj:
            if required:
                errors.append(f"{where}.{name}: required")
        elif not isinstance(obj[name], kind) or (kind is int and isinstance(obj[name], bool)):
            errors.append(f"{where}.{name}: {type(obj[name]).__name__}, want {kind.__name__}")
    return errors


def _check_start_params(params: dict[str, Any], where: str) -> list[str]:
    errors = []
    for k, v in params.items():
        if k not in RAY_START_PARAMS:
            errors.append(f"{where}.{k}: not a ray start option the chart means to set")
        if not isinstance(v, str):
            errors.append(f"{where}.{k}: KubeRay takes string values, got {type(v).__name__}")
    return errors


def raycluster_errors(obj: dict[str, Any]) -> list[str]:
    """Everything wrong with a rendered RayCluster against the fields above (empty: valid)."""
    errors = []
    if obj.get("apiVersion") != "ray.io/v1":
        errors.append(f"apiVersion: {obj.get('apiVersion')!r}, want ray.io/v1")
    errors += _check_fields(obj, {"apiVersion": (str, True, ""), "kind": (str, True, ""), "metadata": (dict, True, ""),
                                  "spec": (dict, True, "")}, "")
    spec = obj.get("spec", {})
    errors += _check_fields(spec, SPEC, "spec")
    head = spec.get("headGroupSpec", {})
    errors += _check_fields(head, HEAD_GROUP, "spec.headGroupSpec")
    errors += _check_start_params(head.get("rayStartParams", {}), "spec.headGroupSpec.rayStartParams")
    errors += _optional_blocks(spec)
    names = set()
    for i, group in enumerate(spec.get("workerGroupSpecs", [])):
        where = f"spec.workerGroupSpecs[{i}]"
        errors += _check_fields(group, WORKER_GROUP, where)
        errors += _check_start_params(group.get("rayStartParams", {}), f"{where}.rayStartParams")
        if group.get("groupName") in names:
            errors.append(f"{where}.groupName: {group.get('groupName')!r} twice")
        names.add(group.get("groupName"))
        lo, n, hi = group.get("minReplicas", 0), group.get("replicas", 0), group.get("maxReplicas", 0)
        if not (isinstance(lo, int) and isinstance(n, int) and isinstance(hi, int) and 0 <= lo <= n <= hi):
            errors.append(f"{where}: want 0 <= minReplicas <= replicas <= maxReplicas, got {lo}, {n}, {hi}")
    return errors


def _optional_blocks(spec: dict[str, Any]) -> list[str]:
    """upgradeStrategy, autoscalerOptions and gcsFaultToleranceOptions, where present."""
    errors = []
    if "upgradeStrategy" in spec:
        errors += _check_fields(spec["upgradeStrategy"], UPGRADE_STRATEGY, "spec.upgradeStrategy")
        if spec["upgradeStrategy"].get("type") not in UPGRADE_TYPES:
            errors.append(f"spec.upgradeStrategy.type: {spec['upgradeStrategy'].get('type')!r}, want one of {UPGRADE_TYPES}")
    if "autoscalerOptions" in spec:
        errors += _check_fields(spec["autoscalerOptions"], AUTOSCALER_OPTIONS, "spec.autoscalerOptions")
        mode = spec["autoscalerOptions"].get("upscalingMode", "Default")
        if mode not in UPSCALING_MODES:
            errors.append(f"spec.autoscalerOptions.upscalingMode: {mode!r}, want one of {UPSCALING_MODES}")
    if "gcsFaultToleranceOptions" in spec:
        ft = spec["gcsFaultToleranceOptions"]
        errors += _check_fields(ft, GCS_FT_OPTIONS, "spec.gcsFaultToleranceOptions")
        if "redisPassword" in ft:
            where = "spec.gcsFaultToleranceOptions.redisPassword"
            errors += _check_fields(ft["redisPassword"], REDIS_CREDENTIAL, where)
    if spec.get("autoscalerOptions") and not spec.get("enableInTreeAutoscaling"):
        errors.append("spec.autoscalerOptions: set while enableInTreeAutoscaling is off")
    return errors


# The Prometheus operator's ServiceMonitor (monitoring.coreos.com/v1): the fields the chart uses.
SERVICE_MONITOR_SPEC: dict[str, tuple[type, bool, str]] = {
    "selector": (dict, True, "label selector of the Services to scrape"),
    "endpoints": (list, True, "which port of those Services to scrape, how often, at which path"),
}
SERVICE_MONITOR_ENDPOINT: dict[str, tuple[type, bool, str]] = {
    "port": (str, False, "the Service port's name"),
    "path": (str, False, "the HTTP path of the metrics"),
    "interval": (str, False, "scrape interval, a Prometheus duration"),
    "relabelings": (list, False, "relabel configs applied to the target before the scrape"),
}
RELABELING: dict[str, tuple[type, bool, str]] = {
    "sourceLabels": (list, False, "labels whose values are joined and matched"),
    "targetLabel": (str, False, "the label the result is written to"),
}


def service_monitor_errors(obj: dict[str, Any]) -> list[str]:
    errors = []
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"apiVersion: {obj.get('apiVersion')!r}, want monitoring.coreos.com/v1")
    spec = obj.get("spec", {})
    errors += _check_fields(spec, SERVICE_MONITOR_SPEC, "spec")
    for i, ep in enumerate(spec.get("endpoints", [])):
        errors += _check_fields(ep, SERVICE_MONITOR_ENDPOINT, f"spec.endpoints[{i}]")
        for j, rl in enumerate(ep.get("relabelings", [])):
            errors += _check_fields(rl, RELABELING, f"spec.endpoints[{i}].relabelings[{j}]")
    return errors
