"""The chart's pods as a platform team configures them: the pod-spec escape hatches on every pod,
keys from Secrets and never in a container's arguments, the router without a GPU, probes and
progress deadlines as values, and images pinned by digest. Every value set here also goes
through strict lint and kubernetes-validate in test_helm_chart.py (helm_value_sets.VALUE_SETS)."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest
from helm_objects import NAMESPACE, by_kind, one, render, replica_script, router_script
from helm_value_sets import POD_HATCHES, VALUE_SETS, env_of, pod_specs

pytestmark = pytest.mark.deploy

COMPONENTS = ("ray-head", "prefill", "decode", "router", "router-replica")


def templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> pod template (metadata and spec), for every pod the release runs."""
    rc = one(objects, "RayCluster")["spec"]
    found = {"ray-head": rc["headGroupSpec"]["template"]}
    found.update({g["groupName"]: g["template"] for g in rc.get("workerGroupSpecs", [])})
    for dep in by_kind(objects, "Deployment"):
        comp = "router-replica" if dep["metadata"]["name"].endswith("-replica") else "router"
        found[comp] = dep["spec"]["template"]
    return found


def all_containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in templates(objects).values():
        out += t["spec"]["containers"] + t["spec"].get("initContainers", [])
    return out


# ----- escape hatches ------------------------------------------------------------------------


def test_every_hatch_reaches_every_pod(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["pod_spec"])
    found = templates(objects)
    assert set(found) == set(COMPONENTS)
    for comp, t in found.items():
        meta, spec = t["metadata"], t["spec"]
        assert meta["annotations"] == POD_HATCHES["podAnnotations"], comp
        assert meta["labels"]["team"] == "inference", comp
        # The chart's own labels win: the Service, the budgets and the selectors depend on them.
        assert meta["labels"]["app.kubernetes.io/component"] == comp, comp
        assert spec["securityContext"] == POD_HATCHES["podSecurityContext"], comp
        for field in ("runtimeClassName", "serviceAccountName", "priorityClassName", "topologySpreadConstraints",
                      "initContainers"):
            assert spec[field] == POD_HATCHES[field], (comp, field)
        c = spec["containers"][0]
        env = env_of(c)
        assert env["NCCL_DEBUG"] == "WARN" and env["SITE_TOKEN"] == {"secretKeyRef": {"name": "site", "key": "token"}}
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # the chart's env stays
        assert {"name": "site-config", "mountPath": "/etc/site", "readOnly": True} in c["volumeMounts"], comp
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"], comp
        assert {"name": "site-config", "configMap": {"name": "site-config"}} in spec["volumes"], comp
        assert c["securityContext"] == POD_HATCHES["securityContext"], comp  # ipcLock off: as given
    # The Deployments still select their own pods.
    for dep in by_kind(objects, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_pool_security_context_keeps_ipc_lock(chart: helm.Chart) -> None:
    sc = {"runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    specs = pod_specs(render(chart, {"prefill": {"securityContext": sc}}))
    prefill, decode = (specs[r]["containers"][0]["securityContext"] for r in ("prefill", "decode"))
    assert prefill == {"runAsNonRoot": True, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    assert decode == {"capabilities": {"add": ["IPC_LOCK"]}}
    off = pod_specs(render(chart, {"kv": {"ipcLock": False}}))
    assert "securityContext" not in off["decode"]["containers"][0]


def test_no_hatch_set_renders_none(chart: helm.Chart) -> None:
    for comp, t in templates(render(chart, {"router": {"replicas": 2}})).items():
        spec = t["spec"]
        assert "annotations" not in t["metadata"], comp
        for field in ("runtimeClassName", "serviceAccountName", "priorityClassName", "topologySpreadConstraints",
                      "initContainers", "securityContext"):
            assert field not in spec, (comp, field)


# ----- the router's GPU, probes, deadlines ---------------------------------------------------


def test_router_asks_no_gpu_by_default(chart: helm.Chart) -> None:
    objects = render(chart, {"router": {"replicas": 3}})
    for comp in ("router", "router-replica"):
        res = templates(objects)[comp]["spec"]["containers"][0]["resources"]
        for kind in ("requests", "limits"):
            assert not any(k.startswith("nvidia.com/") for k in res[kind]), (comp, kind)
    assert "--device" in router_script(objects)  # the workers' device: resolved on the cluster's nodes
    # Asked for, the first router gets one (the old behaviour), the others never.
    one_gpu = templates(render(chart, {"router": {"replicas": 2, "gpus": 1}}))
    assert one_gpu["router"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in one_gpu["router-replica"]["spec"]["containers"][0]["resources"]["limits"]
    assert templates(render(chart, {"router": {"gpus": None}}))["router"]["spec"]["containers"][0][
        "resources"]["limits"].keys() == {"cpu", "memory"}


def test_probes_and_deadlines_are_values(chart: helm.Chart) -> None:
    objects = render(chart, {"router": {"replicas": 2}})
    for dep in by_kind(objects, "Deployment"):
        spec = dep["spec"]
        c = spec["template"]["spec"]["containers"][0]
        window = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        assert window == 900 and spec["progressDeadlineSeconds"] == 1200 > window  # rollout status waits it out
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["timeoutSeconds"] == 5, probe
        assert c["readinessProbe"]["failureThreshold"] == 3 and c["livenessProbe"]["failureThreshold"] == 6
    tuned = one(render(chart, VALUE_SETS["lifecycle"]), "Deployment", "-router")["spec"]
    c = tuned["template"]["spec"]["containers"][0]
    assert tuned["progressDeadlineSeconds"] == 1000
    assert (c["startupProbe"]["periodSeconds"], c["startupProbe"]["failureThreshold"]) == (15, 60)
    assert c["livenessProbe"]["timeoutSeconds"] == 3 and c["readinessProbe"]["periodSeconds"] == 15
    # With TLS the probe is an exec of a Python health call (5 s deadline inside): at least 10 s.
    tls = one(render(chart, VALUE_SETS["tls"]), "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert tls["livenessProbe"]["timeoutSeconds"] == 10


def test_progress_deadline_must_outlast_the_start_up_window(chart: helm.Chart) -> None:
    values = {"router": {"progressDeadlineSeconds": 900}}  # = 90 x 10 s
    with pytest.raises(helm.HelmRenderError, match="router.progressDeadlineSeconds: 900 must be longer"):
        chart.render(values=values, name="demo", namespace=NAMESPACE)


def test_readiness_follows_the_workers(chart: helm.Chart) -> None:
    """Readiness asks pdserve.v1.Inference, NOT_SERVING while no decode worker is in placement."""
    for comp, t in templates(render(chart, {"router": {"replicas": 2}})).items():
        if comp.startswith("router"):
            c = t["spec"]["containers"][0]
            assert c["readinessProbe"]["grpc"]["service"] == "pdserve.v1.Inference"
            assert c["livenessProbe"]["grpc"]["service"] == "pdserve.v1.Admin"


# ----- secrets -------------------------------------------------------------------------------

SECRET_ENV = ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY", "RAY_AUTH_TOKEN", "HF_TOKEN", "SITE_TOKEN")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_no_secret_in_any_container_args(chart: helm.Chart, name: str) -> None:
    objects = render(chart, VALUE_SETS[name])
    for c in all_containers(objects):
        argv = json.dumps(c.get("command", []) + c.get("args", []))
        for var in SECRET_ENV:
            assert var not in argv, (name, c["name"], var)
        assert "--admin-api-key" not in argv and "--api-key " not in argv, (name, c["name"])
        # Every env entry whose value is a secret comes by reference, never as a literal.
        for e in c.get("env", []):
            if e["name"] in SECRET_ENV:
                assert set(e) == {"name", "valueFrom"} and "secretKeyRef" in e["valueFrom"], (name, e["name"])


def test_keys_come_from_secrets_as_env(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["pod_spec"])
    for comp in ("router", "router-replica"):
        env = env_of(templates(objects)[comp]["spec"]["containers"][0])
        assert env["PDSERVE_API_KEY"] == {"secretKeyRef": {"name": "pdserve-data", "key": "api-key"}}
        assert env["PDSERVE_ADMIN_API_KEY"] == {"secretKeyRef": {"name": "pdserve-admin", "key": "admin-api-key"}}
    for script in (router_script(objects), replica_script(objects)):
        assert "'--api-key-file' '/etc/pdserve/api-keys/api-keys'" in script  # a file path, not a key
    for comp in ("ray-head", "prefill", "decode"):  # the keys stay on the routers
        env = env_of(templates(objects)[comp]["spec"]["containers"][0])
        assert "PDSERVE_API_KEY" not in env and "PDSERVE_ADMIN_API_KEY" not in env


# ----- images ----------------------------------------------------------------------------------


def test_image_by_digest(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["pod_spec"])
    want = "registry.example.com:5000/ml/pdserve@sha256:" + "ab" * 32
    for c in (t["spec"]["containers"][0] for t in templates(objects).values()):
        assert c["image"] == want
    tagged = render(chart, {"image": {"repository": "ghcr.io/x/pdserve", "tag": "0.2.0"}})
    assert {t["spec"]["containers"][0]["image"] for t in templates(tagged).values()} == {"ghcr.io/x/pdserve:0.2.0"}


@pytest.mark.parametrize(
    ("image", "field"),
    [
        ({"tag": "sha256:" + "ab" * 32}, "/image/tag"),  # a digest in the tag: an invalid reference before
        ({"tag": "0.1@sha256:" + "ab" * 32}, "/image/tag"),
        ({"digest": "sha256:abc"}, "/image/digest"),
        ({"digest": "md5:" + "ab" * 16}, "/image/digest"),
        ({"repository": "pdserve@sha256:" + "ab" * 32}, "/image/repository"),
    ],
)
def test_malformed_image_references_are_refused(chart: helm.Chart, image: dict[str, str], field: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values={"image": image}, name="demo", namespace=NAMESPACE)
    assert field in str(err.value)
