"""The KubeRay `ray.io/v1` RayCluster fields the chart uses, with their meaning, checked strictly.

No package registry this project uses (PyPI, npm, Debian) ships KubeRay's CRD schema, so the
RayCluster is checked against this list instead: an unknown field, a missing required one or a
wrong type fails. The pod templates inside it are core `PodTemplateSpec`s and are validated
against the Kubernetes schemas like every other object (test_helm_chart.py).
"""

from __future__ import annotations

from typing import Any

# field -> (type, required, meaning)
SPEC: dict[str, tuple[type, bool, str]] = {
    "rayVersion": (str, False, "the Ray version in the image; KubeRay adapts its start command to it"),
    "enableInTreeAutoscaling": (bool, False, "run KubeRay's autoscaler sidecar (off: the pools are fixed)"),
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
    "minReplicas": (int, True, "autoscaler floor (equal to replicas: fixed pools)"),
    "maxReplicas": (int, True, "autoscaler ceiling (equal to replicas: fixed pools)"),
    "rayStartParams": (dict, False, "`ray start` flags (string values) for the group's pods"),
    "template": (dict, True, "the group's PodTemplateSpec"),
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


# The Prometheus operator's ServiceMonitor (monitoring.coreos.com/v1): the fields the chart uses.
SERVICE_MONITOR_SPEC: dict[str, tuple[type, bool, str]] = {
    "selector": (dict, True, "label selector of the Services to scrape"),
    "endpoints": (list, True, "which port of those Services to scrape, how often, at which path"),
}
SERVICE_MONITOR_ENDPOINT: dict[str, tuple[type, bool, str]] = {
    "port": (str, False, "the Service port's name"),
    "path": (str, False, "the HTTP path of the metrics"),
    "interval": (str, False, "scrape interval, a Prometheus duration"),
}


def service_monitor_errors(obj: dict[str, Any]) -> list[str]:
    errors = []
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"apiVersion: {obj.get('apiVersion')!r}, want monitoring.coreos.com/v1")
    spec = obj.get("spec", {})
    errors += _check_fields(spec, SERVICE_MONITOR_SPEC, "spec")
    for i, ep in enumerate(spec.get("endpoints", [])):
        errors += _check_fields(ep, SERVICE_MONITOR_ENDPOINT, f"spec.endpoints[{i}]")
    return errors
