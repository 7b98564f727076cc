"""The RayCluster's day-two options: KubeRay's upgradeStrategy, a budget for the Ray head, GCS fault
tolerance on an external Redis, and KubeRay's autoscaler with per-pool bounds and the controller's
--max-workers. The field names are KubeRay's ray.io/v1 (kuberay_fields.py checks them)."""

from __future__ import annotations

import shlex
from typing import Any

import helm_python as helm
import pytest
from helm_objects import NAMESPACE, by_kind, one, render, serve_command
from helm_value_sets import VALUE_SETS
from kuberay_fields import raycluster_errors

pytestmark = pytest.mark.deploy


def raycluster(chart: helm.Chart, values: dict[str, Any] | None = None) -> dict[str, Any]:
    rc = one(render(chart, values), "RayCluster")
    assert raycluster_errors(rc) == []
    return rc["spec"]


# ----- upgrades ----------------------------------------------------------------------------


def test_upgrade_strategy(chart: helm.Chart) -> None:
    assert raycluster(chart)["upgradeStrategy"] == {"type": "None"}  # pools rolled by hand, one pod at a time
    assert raycluster(chart, {"upgradeStrategy": "Recreate"})["upgradeStrategy"] == {"type": "Recreate"}
    assert "upgradeStrategy" not in raycluster(chart, {"upgradeStrategy": ""})  # for KubeRay before 1.6
    with pytest.raises(helm.HelmValuesError, match="/upgradeStrategy"):
        chart.render(values={"upgradeStrategy": "RollingUpdate"}, name="demo", namespace=NAMESPACE)


def test_kuberay_check_refuses_an_unknown_upgrade_type(chart: helm.Chart) -> None:
    rc = one(render(chart), "RayCluster")
    rc["spec"]["upgradeStrategy"]["type"] = "Rolling"
    assert any("upgradeStrategy.type" in e for e in raycluster_errors(rc))


# ----- the Ray head: budget and GCS fault tolerance ------------------------------------------


def head_budget(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "PodDisruptionBudget", "-head")["spec"]


def test_head_budget_selects_the_head_alone(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["routers"])
    budget = head_budget(objects)
    assert budget == {
        "maxUnavailable": 0,  # without GCS fault tolerance, evicting the head loses every worker
        "selector": {"matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "demo",
                                     "app.kubernetes.io/component": "ray-head"}},
    }
    rc = one(objects, "RayCluster")["spec"]
    pods = {"ray-head": rc["headGroupSpec"]["template"]["metadata"]["labels"]}
    pods.update({g["groupName"]: g["template"]["metadata"]["labels"] for g in rc["workerGroupSpecs"]})
    pods.update({d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in by_kind(objects, "Deployment")})
    # Each pod under exactly one budget (a pod under two cannot be evicted at all).
    for name, labels in pods.items():
        under = [p for p in by_kind(objects, "PodDisruptionBudget")
                 if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(under) == 1, (name, [p["metadata"]["name"] for p in under])
    assert not by_kind(render(chart, {"podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget")


def test_gcs_fault_tolerance(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["lifecycle"])
    rc = one(objects, "RayCluster")
    assert raycluster_errors(rc) == []
    assert rc["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.pdserve-system:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}},
    }
    assert head_budget(objects)["maxUnavailable"] == 1  # a restarted head reads its state back
    assert "gcsFaultToleranceOptions" not in raycluster(chart)
    no_password = {"gcsFaultTolerance": {"enabled": True, "redisAddress": "10.0.0.9:6379",
                                         "externalStorageNamespace": "pdserve-prod"}}
    assert raycluster(chart, no_password)["gcsFaultToleranceOptions"] == {
        "redisAddress": "10.0.0.9:6379", "externalStorageNamespace": "pdserve-prod"}


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"gcsFaultTolerance": {"enabled": True}}, "/gcsFaultTolerance"),
        ({"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis://r:6379"}}, "/gcsFaultTolerance/redisAddress"),
        ({"gcsFaultTolerance": {"passwordSecret": {"name": "Redis_Pw"}}}, "/gcsFaultTolerance/passwordSecret/name"),
        ({"autoscaling": {"upscalingMode": "Fast"}}, "/autoscaling/upscalingMode"),
        ({"decode": {"maxReplicas": 0}}, "/decode/maxReplicas"),
        ({"controller": {"maxWorkers": -1}}, "/controller/maxWorkers"),
        ({"router": {"probes": {"timeoutSeconds": 0}}}, "/router/probes/timeoutSeconds"),
        ({"prefill": {"extraVolumes": [{"name": "dshm", "emptyDir": {}}]}}, "/prefill/extraVolumes/0/name"),
        ({"router": {"initContainers": [{"name": "x"}]}}, "/router/initContainers/0"),
        ({"head": {"podLabels": {"team": "a b"}}}, "/head/podLabels/team"),
    ],
)
def test_rejected(chart: helm.Chart, values: dict[str, Any], field: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values=values, name="demo", namespace=NAMESPACE)
    assert field in str(err.value)


# ----- autoscaling -----------------------------------------------------------------------------


def test_fixed_pools_by_default(chart: helm.Chart) -> None:
    spec = raycluster(chart, {"decode": {"replicas": 3, "maxReplicas": 9}})  # bounds unused while off
    assert spec["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in spec
    for g in spec["workerGroupSpecs"]:
        assert g["minReplicas"] == g["replicas"] == g["maxReplicas"]


def test_autoscaling(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["lifecycle"])
    spec = one(objects, "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"] == {"idleTimeoutSeconds": 300, "upscalingMode": "Conservative"}
    groups = {g["groupName"]: (g["minReplicas"], g["replicas"], g["maxReplicas"]) for g in spec["workerGroupSpecs"]}
    assert groups == {"prefill": (1, 2, 4), "decode": (4, 4, 8)}  # decode's floor: its replicas
    cmd = shlex.split(serve_command(objects))
    assert cmd[cmd.index("--max-workers") + 1] == "12"
    assert "--max-workers" not in serve_command(render(chart, VALUE_SETS["controller"]))


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"replicas": 2}, "decode: with autoscaling.enabled, want minReplicas <= replicas <= maxReplicas"),  # no max
        ({"replicas": 2, "maxReplicas": 2}, "minReplicas < maxReplicas; got 2, 2, 2"),
        ({"replicas": 2, "minReplicas": 3, "maxReplicas": 5}, "got 3, 2, 5"),
        ({"replicas": 6, "maxReplicas": 5}, "got 6, 6, 5"),
    ],
)
def test_autoscaling_bounds_are_checked(chart: helm.Chart, pool: dict[str, Any], message: str) -> None:
    values = {"autoscaling": {"enabled": True}, "prefill": {"replicas": 1, "maxReplicas": 2}, "decode": pool}
    with pytest.raises(helm.HelmRenderError, match=message.replace("(", r"\(")):
        chart.render(values=values, name="demo", namespace=NAMESPACE)


def test_max_workers_needs_the_controller(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="controller.maxWorkers: only with controller.enabled"):
        chart.render(values={"controller": {"maxWorkers": 8}}, name="demo", namespace=NAMESPACE)


def test_the_controller_may_serve_colocated_when_asked(chart: helm.Chart) -> None:
    asked = {"controller": {**VALUE_SETS["controller"]["controller"], "colocated": True}}
    assert "--controller-colocated" in shlex.split(serve_command(render(chart, asked)))
    assert "--controller-colocated" not in serve_command(render(chart, VALUE_SETS["controller"]))
    with pytest.raises(helm.HelmRenderError, match="controller.colocated: only with controller.enabled"):
        chart.render(values={"controller": {"colocated": True}}, name="demo", namespace=NAMESPACE)


def test_notes_say_how_pools_roll(chart: helm.Chart) -> None:
    def notes(values: dict[str, Any]) -> str:
        return chart.render(values=values, name="demo", namespace=NAMESPACE)["pdserve/templates/NOTES.txt"]

    default = notes({})
    assert "roll each pool by hand" in default and "The Ray head admits no voluntary eviction" in default
    recreate = notes({"upgradeStrategy": "Recreate", **{k: VALUE_SETS["lifecycle"][k] for k in ("gcsFaultTolerance",)}})
    assert "roll each pool by hand" not in recreate and "Ray head admits no" not in recreate
