"""The Helm chart (deploy/helm/pdserve) rendered with the real Helm SDK: strict lint, every object
valid against the Kubernetes schemas, and what each value set must put into the objects."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from helm_objects import (
    CHART_DIR,
    NAMESPACE,
    REPO,
    by_kind,
    exec_line,
    one,
    render,
    replica_script,
    router_script,
    serve_command,
)
from helm_value_sets import VALUE_SETS, env_of, pod_specs
from kuberay_fields import raycluster_errors, service_monitor_errors

pytestmark = pytest.mark.deploy

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version() + ".0")

# ----- the chart as a whole ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(name: str) -> None:
    report = helm.lint(CHART_DIR, VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version="v1.27.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2: warning, 3: error
    assert not report["errors"] and not problems, (report["errors"], problems)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_object_valid(chart: helm.Chart, name: str) -> None:
    objects = render(chart, VALUE_SETS[name])
    assert objects
    for obj in objects:
        kind = obj["kind"]
        if kind == "RayCluster":
            assert raycluster_errors(obj) == []
            rc = obj["spec"]
            templates = [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc.get("workerGroupSpecs", [])]
            for t in templates:  # the pods inside are core objects: validate them as such
                for v in KUBE_VERSIONS:
                    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": t}
                    kubernetes_validate.validate(pod_template, v, strict=True)
        elif kind == "ServiceMonitor":
            assert service_monitor_errors(obj) == []
        else:
            for v in KUBE_VERSIONS:
                kubernetes_validate.validate(obj, v, strict=True)


def test_kubernetes_validate_is_strict() -> None:
    """The validation above would catch a misspelt field (strict mode rejects unknown ones)."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)


def test_kuberay_field_check_catches_mistakes(chart: helm.Chart) -> None:
    rc = one(render(chart), "RayCluster")
    group = rc["spec"]["workerGroupSpecs"][0]
    group["replica"] = group.pop("replicas")
    group["rayStartParams"]["num-gpus"] = 1
    errors = raycluster_errors(rc)
    assert any("replica: not a field" in e for e in errors)
    assert any("num-gpus: KubeRay takes string values" in e for e in errors)


def test_default_objects(chart: helm.Chart) -> None:
    kinds = sorted(o["kind"] for o in render(chart))
    assert kinds == sorted(
        [
            "RayCluster",
            "Deployment",
            "Service",
            "NetworkPolicy",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
        ]
    )


# ----- pools ---------------------------------------------------------------------------------


def test_worker_groups_and_gpus(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["multi_gpu"])
    rc = one(objects, "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, (replicas, gpus) in {"prefill": (2, 4), "decode": (3, 8)}.items():
        g = groups[role]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == replicas
        c = g["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {f"pdserve_{role}": gpus}
        assert g["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
    prefill = groups["prefill"]["template"]["spec"]
    assert prefill["nodeSelector"] == {"gpu": "h100"}
    assert prefill["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "podAntiAffinity" in prefill["affinity"]
    assert "nodeSelector" not in groups["decode"]["template"]["spec"]
    # Today each pdserve worker takes one GPU: replicas x gpus workers per pool.
    cmd = shlex.split(serve_command(objects))
    assert cmd[cmd.index("--prefill") + 1] == "8" and cmd[cmd.index("--decode") + 1] == "24"


def test_head_takes_no_worker(chart: helm.Chart) -> None:
    head = one(render(chart), "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_colocated_has_no_prefill_group(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["colocated"])
    groups = [g["groupName"] for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"]]
    assert groups == ["decode"]
    cmd = shlex.split(serve_command(objects))
    assert cmd[cmd.index("--prefill") + 1] == "0" and cmd[cmd.index("--decode") + 1] == "4"
    assert not by_kind(objects, "PodDisruptionBudget") and not by_kind(objects, "NetworkPolicy")


def test_pool_pods_shm_ipc_lock(chart: helm.Chart) -> None:
    specs = pod_specs(render(chart, VALUE_SETS["multi_gpu"]))
    for role in ("prefill", "decode"):
        spec = specs[role]
        c = spec["containers"][0]
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


# ----- KV transfer: addresses, UCX, RDMA -----------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_no_address_is_all_interfaces(chart: helm.Chart, name: str) -> None:
    manifests = chart.render(values=VALUE_SETS[name], name="demo", namespace=NAMESPACE)
    assert not any("0.0.0.0" in text for text in manifests.values())


def test_ray_and_router_on_the_pod_ip(chart: helm.Chart) -> None:
    objects = render(chart)
    rc = one(objects, "RayCluster")["spec"]
    for params in [rc["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in rc["workerGroupSpecs"]]:
        assert params["node-ip-address"] == "$POD_IP"
    for spec in pod_specs(objects).values():
        assert env_of(spec["containers"][0])["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    script = router_script(objects)
    assert '--node-ip-address="$POD_IP"' in script
    assert serve_command(objects).startswith('exec pdserve serve --host "$POD_IP"')
    # A new router pod (a roll, an eviction) adopts the workers the last one left serving.
    assert "'--keep-workers'" in serve_command(objects).split()


def test_no_ucx_tls_pin_by_default(chart: helm.Chart) -> None:
    for spec in pod_specs(render(chart)).values():
        assert not any(k.startswith("UCX_") for k in env_of(spec["containers"][0]))
    pinned = pod_specs(render(chart, {"kv": {"ucxTls": "rc,cuda_copy"}}))
    for role in ("prefill", "decode"):
        assert env_of(pinned[role]["containers"][0])["UCX_TLS"] == "rc,cuda_copy"


def test_rdma(chart: helm.Chart) -> None:
    specs = pod_specs(render(chart, VALUE_SETS["rdma"]))
    for role in ("prefill", "decode"):
        c = specs[role]["containers"][0]
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == "2"
        assert env_of(c)["UCX_NET_DEVICES"] == "mlx5_0:1" and env_of(c)["UCX_IB_GID_INDEX"] == "3"
    assert "rdma/hca_shared_devices_a" not in specs["router"]["containers"][0]["resources"]["limits"]
    default = pod_specs(render(chart))
    assert not any(k.startswith("rdma/") for k in default["prefill"]["containers"][0]["resources"]["limits"])


# ----- the router ----------------------------------------------------------------------------


def test_router_service_ports(chart: helm.Chart) -> None:
    objects = render(chart)
    svc = one(objects, "Service", "-router")
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert ports == {"grpc": (50051, "grpc"), "http": (8000, "http"), "metrics": (9400, "metrics")}
    dep = one(objects, "Deployment", "-router")
    assert dep["spec"]["replicas"] == 1
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}
    cmd = shlex.split(serve_command(objects))
    for flag, value in {
        "--port": "50051",
        "--http-port": "8000",
        "--metrics-port": "9400",
        "--address": "auto",
        "--device": "cuda",
    }.items():
        assert cmd[cmd.index(flag) + 1] == value


# Readiness asks Inference (NOT_SERVING without a decode worker: no traffic); start-up and liveness
# ask Admin (SERVING while the process runs: a decode outage does not restart the router).
PROBE_SERVICES = {"startupProbe": "pdserve.v1.Admin", "readinessProbe": "pdserve.v1.Inference",
                  "livenessProbe": "pdserve.v1.Admin"}


def test_router_probes_use_grpc_health(chart: helm.Chart) -> None:
    container = one(render(chart), "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    for probe, service in PROBE_SERVICES.items():
        assert container[probe]["grpc"] == {"port": 50051, "service": service}


def test_router_joins_ray_without_resources(chart: helm.Chart) -> None:
    script = router_script(render(chart))
    assert "ray start --address=demo-pdserve-head-svc:6379" in script
    assert "--num-cpus=0 --num-gpus=0" in script


def test_model_sources(chart: helm.Chart) -> None:
    pvc = render(chart, VALUE_SETS["multi_gpu"])
    cmd = shlex.split(serve_command(pvc))
    assert cmd[cmd.index("--model") + 1] == "/models/llama-3.1-8b-instruct"
    assert cmd[cmd.index("--max-model-len") + 1] == "8192" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    specs = pod_specs(pvc)
    for comp in ("router", "prefill", "decode"):
        vols = {v["name"]: v for v in specs[comp]["volumes"]}
        assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert "model-cache" not in vols

    gguf = render(chart, VALUE_SETS["rdma"])
    cmd = shlex.split(serve_command(gguf))
    assert cmd[cmd.index("--model") + 1] == "/models/llama-3.2-1b.Q8_0.gguf"
    for comp in ("router", "prefill", "decode"):  # the converted model must be where every worker reads it
        spec = pod_specs(gguf)[comp]
        assert {"name": "model-cache", "mountPath": "/var/cache/pdserve"} in spec["containers"][0]["volumeMounts"]
        assert env_of(spec["containers"][0])["PDSERVE_CACHE_DIR"] == "/var/cache/pdserve"

    hub = render(chart, VALUE_SETS["controller"])
    cmd = shlex.split(serve_command(hub))
    assert cmd[cmd.index("--model") + 1] == "Qwen/Qwen2.5-1.5B-Instruct"
    router_env = env_of(pod_specs(hub)["router"]["containers"][0])
    assert router_env["HF_HOME"] == "/var/cache/pdserve/hf"
    assert router_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}

    assert "--model" not in shlex.split(serve_command(render(chart)))  # the embedded default


def test_tls_api_keys_otel(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["tls"])
    cmd = shlex.split(serve_command(objects))
    expected = {
        "--ssl-certfile": "/etc/pdserve/tls/tls.crt",
        "--ssl-keyfile": "/etc/pdserve/tls/tls.key",
        "--ssl-ca-certs": "/etc/pdserve/tls/ca.crt",
        "--api-key-file": "/etc/pdserve/api-keys/api-keys",
        "--trace-exporter": "otlp-grpc",
        "--trace-endpoint": "otel-collector.observability:4317",
        "--trace-sample-ratio": "0.1",
    }
    for flag, value in expected.items():
        assert cmd[cmd.index(flag) + 1] == value, flag
    assert "--admin-api-key" not in cmd  # the server reads PDSERVE_ADMIN_API_KEY from the env below
    spec = pod_specs(objects)["router"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["tls"] == {"name": "tls", "secret": {"secretName": "pdserve-tls"}}
    assert vols["api-keys"] == {"name": "api-keys", "secret": {"secretName": "pdserve-keys"}}
    c = spec["containers"][0]
    assert env_of(c)["PDSERVE_ADMIN_API_KEY"] == {"secretKeyRef": {"name": "pdserve-admin", "key": "admin-api-key"}}
    # The kubelet's gRPC probe has no TLS: the health check runs in the pod against the same service.
    for probe, service in PROBE_SERVICES.items():
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["python", "-c"] and f"service='{service}'" in command[2]
        compile(command[2], "probe", "exec")
    assert "--ssl-certfile" not in serve_command(render(chart))


def test_controller_flags(chart: helm.Chart) -> None:
    cmd = shlex.split(serve_command(render(chart, VALUE_SETS["controller"])))
    assert "--controller" in cmd
    assert cmd[cmd.index("--slo-ttft-ms") + 1] == "300" and cmd[cmd.index("--slo-itl-ms") + 1] == "40"
    assert "--controller" not in serve_command(render(chart))


def test_extra_args_are_quoted(chart: helm.Chart) -> None:
    extra = ["--max-num-seqs", "128", "--lease-s", "60 s"]
    cmd = shlex.split(serve_command(render(chart, {"router": {"extraArgs": extra}})))
    assert cmd[-4:] == extra


# ----- router replicas -----------------------------------------------------------------------


def router_pod_labels(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Deployment name -> its pods' labels, for every router Deployment."""
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in by_kind(objects, "Deployment")}


def test_one_router_renders_no_replicas(chart: helm.Chart) -> None:
    objects = render(chart)
    assert [d["metadata"]["name"] for d in by_kind(objects, "Deployment")] == ["demo-pdserve-router"]
    assert "exec pdserve router" not in json.dumps(objects)
    router_pdb = one(objects, "PodDisruptionBudget", "-router")["spec"]
    assert router_pdb["maxUnavailable"] == 1 and "minAvailable" not in router_pdb


def test_router_replicas_deployment(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["routers"])
    first = one(objects, "Deployment", "-router")
    replicas = one(objects, "Deployment", "-router-replica")
    # The first router still starts and owns the pools: one pod, one at a time.
    assert first["spec"]["replicas"] == 1 and first["spec"]["strategy"] == {"type": "Recreate"}
    assert replicas["spec"]["replicas"] == 2
    script = replica_script(objects)
    assert "ray start --address=demo-pdserve-head-svc:6379" in script
    assert '--node-ip-address="$POD_IP" --num-cpus=0 --num-gpus=0' in script
    assert script.index("ray health-check") < script.index("ray start") < script.index("exec pdserve router")
    line = exec_line(script, "router")
    assert line.startswith('exec pdserve router --host "$POD_IP"')
    cmd = shlex.split(line)
    serve = shlex.split(serve_command(objects))
    assert cmd[cmd.index("--address") + 1] == "auto"
    # The same edge as the first router: ports, TLS, API keys, admin key, traces.
    for flag in (
        "--port",
        "--http-port",
        "--metrics-port",
        "--ssl-certfile",
        "--ssl-keyfile",
        "--api-key-file",
        "--trace-exporter",
        "--trace-endpoint",
        "--trace-sample-ratio",
    ):
        assert cmd[cmd.index(flag) + 1] == serve[serve.index(flag) + 1], flag
    assert "--admin-api-key" not in cmd and "--admin-api-key" not in serve  # env from the Secret instead
    # The first router alone exports the workers' series.
    assert "--no-export-worker-metrics" in cmd and "--no-export-worker-metrics" not in serve
    # Nothing only `pdserve serve` takes (`pdserve router` would refuse it): the workers say the rest.
    for flag in ("--device", "--prefill", "--decode", "--placement-policy", "--dtype", "--model", "--max-num-seqs"):
        assert flag not in cmd, flag
    # Each Deployment gets its own extra flags.
    assert cmd[cmd.index("--max-queued-requests") + 1] == "256" and "--max-queued-requests" not in serve
    assert serve[serve.index("--max-num-seqs") + 1] == "128"

    spec = replicas["spec"]["template"]["spec"]
    first_spec = first["spec"]["template"]["spec"]
    c, first_c = spec["containers"][0], first_spec["containers"][0]
    for container in (c, first_c):  # no router holds a GPU: the workers' device is the cluster's
        assert not any(k.startswith("nvidia.com/") for k in container["resources"]["limits"])
        assert not any(k.startswith("nvidia.com/") for k in container["resources"]["requests"])
    assert c["ports"] == first_c["ports"]
    for probe, service in PROBE_SERVICES.items():
        assert c[probe] == first_c[probe] and f"service='{service}'" in c[probe]["exec"]["command"][2]
    assert c["volumeMounts"] == first_c["volumeMounts"] and spec["volumes"] == first_spec["volumes"]
    env = env_of(c)
    assert env["PDSERVE_ADMIN_API_KEY"] == {"secretKeyRef": {"name": "pdserve-admin", "key": "admin-api-key"}}


def test_router_replica_probes_without_tls(chart: helm.Chart) -> None:
    objects = render(chart, {"router": {"replicas": 2}})
    c = one(objects, "Deployment", "-router-replica")["spec"]["template"]["spec"]["containers"][0]
    for probe, service in PROBE_SERVICES.items():
        assert c[probe]["grpc"] == {"port": 50051, "service": service}
    assert c["livenessProbe"]["failureThreshold"] == 6 and c["startupProbe"]["failureThreshold"] == 90


def test_service_spreads_over_every_router(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["routers"])
    selector = one(objects, "Service", "-router")["spec"]["selector"]
    pods = router_pod_labels(objects)
    assert set(pods) == {"demo-pdserve-router", "demo-pdserve-router-replica"}
    for labels in pods.values():
        assert selector.items() <= labels.items()
    rc = one(objects, "RayCluster")["spec"]
    ray_pods = [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]
    assert not any(selector.items() <= t["metadata"]["labels"].items() for t in ray_pods)
    # Each Deployment selects only its own pods (overlapping controllers fight over pods).
    for dep in by_kind(objects, "Deployment"):
        own = dep["spec"]["selector"]["matchLabels"]
        matched = [name for name, labels in pods.items() if own.items() <= labels.items()]
        assert matched == [dep["metadata"]["name"]]


def test_router_replicas_pdb(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["routers"])
    pdbs = {p["metadata"]["name"]: p["spec"] for p in by_kind(objects, "PodDisruptionBudget")}
    assert set(pdbs) == {"demo-pdserve-router", "demo-pdserve-prefill", "demo-pdserve-decode", "demo-pdserve-head"}
    router = pdbs["demo-pdserve-router"]
    assert router["minAvailable"] == 1 and "maxUnavailable" not in router
    for labels in router_pod_labels(objects).values():
        assert router["selector"]["matchLabels"].items() <= labels.items()
    # A pod under two budgets cannot be evicted at all: each router pod is under this one only.
    for name, spec in pdbs.items():
        if name != "demo-pdserve-router":
            for labels in router_pod_labels(objects).values():
                assert not spec["selector"]["matchLabels"].items() <= labels.items()


def test_router_replicas_network_policy(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["routers"])
    replica_labels = router_pod_labels(objects)["demo-pdserve-router-replica"]
    router = one(objects, "NetworkPolicy", "-router")["spec"]
    assert router["podSelector"]["matchLabels"].items() <= replica_labels.items()  # edge ports open to clients
    assert sorted(p["port"] for p in router["ingress"][0]["ports"]) == [8000, 9400, 50051]
    ray = one(objects, "NetworkPolicy", "-ray")["spec"]
    (rule,) = ray["ingress"]
    # The joining routers reach the head's GCS and the workers (actor calls) on any port.
    assert any(p["podSelector"]["matchLabels"].items() <= replica_labels.items() for p in rule["from"])


def test_ray_token_from_the_secret(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["routers"])
    specs = pod_specs(objects)
    assert set(specs) == {"ray-head", "prefill", "decode", "router", "router-replica"}
    for comp, spec in specs.items():
        env = env_of(spec["containers"][0])
        assert env["RAY_AUTH_MODE"] == "token", comp
        assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "pdserve-ray", "key": "auth_token"}}, comp
    for spec in pod_specs(render(chart)).values():  # no token asked for: Ray as before
        assert not any(k.startswith("RAY_AUTH") for k in env_of(spec["containers"][0]))


# ----- policies, monitoring ------------------------------------------------------------------


def test_pod_disruption_budgets(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["multi_gpu"])
    pdbs = {p["metadata"]["name"]: p["spec"] for p in by_kind(objects, "PodDisruptionBudget")}
    assert set(pdbs) == {"demo-pdserve-router", "demo-pdserve-prefill", "demo-pdserve-decode", "demo-pdserve-head"}
    rc = one(objects, "RayCluster")["spec"]
    pod_labels = {g["groupName"]: g["template"]["metadata"]["labels"] for g in rc["workerGroupSpecs"]}
    pod_labels["router"] = one(objects, "Deployment", "-router")["spec"]["template"]["metadata"]["labels"]
    pod_labels["head"] = rc["headGroupSpec"]["template"]["metadata"]["labels"]
    for comp, labels in pod_labels.items():
        spec = pdbs[f"demo-pdserve-{comp}"]
        assert spec["maxUnavailable"] == (0 if comp == "head" else 1)
        assert spec["selector"]["matchLabels"].items() <= labels.items()  # selects that component's pods
        others = [v for k, v in pod_labels.items() if k != comp]
        assert not any(spec["selector"]["matchLabels"].items() <= o.items() for o in others)  # and no other


def test_network_policy(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["tls"])
    router = one(objects, "NetworkPolicy", "-router")["spec"]
    open_rule, cluster_rule = router["ingress"]
    assert sorted(p["port"] for p in open_rule["ports"]) == [8000, 9400, 50051]
    assert open_rule["from"] == [{"namespaceSelector": {"matchLabels": {"name": "clients"}}}]
    assert "ports" not in cluster_rule  # Ray's ports are dynamic
    assert cluster_rule["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": "demo",
    }
    ray = one(objects, "NetworkPolicy", "-ray")["spec"]
    comps = next(e for e in ray["podSelector"]["matchExpressions"] if e["key"] == "app.kubernetes.io/component")
    assert sorted(comps["values"]) == ["decode", "prefill", "ray-head"]
    assert ray["policyTypes"] == ["Ingress"]
    (rule,) = ray["ingress"]
    assert "ports" not in rule and rule["from"] == cluster_rule["from"]  # only the release's own pods, KV included
    default = one(render(chart), "NetworkPolicy", "-router")["spec"]["ingress"][0]
    assert "from" not in default  # the router's ports are open to all by default


def test_service_monitor_and_dashboard(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["controller"])
    sm = one(objects, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"] == [{
        "port": "metrics", "path": "/metrics", "interval": "15s",
        # The dashboard's release variable selects on this label.
        "relabelings": [{"sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_instance"],
                         "targetLabel": "release"}],
    }]
    svc = one(objects, "Service", "-router")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    cm = one(objects, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
    assert json.loads(cm["data"]["pdserve.json"]) == shipped
    assert not by_kind(render(chart), "ServiceMonitor") and not by_kind(render(chart), "ConfigMap")


def test_chart_notes(chart: helm.Chart) -> None:
    manifests = chart.render(values=VALUE_SETS["multi_gpu"], name="demo", namespace=NAMESPACE)
    notes = manifests["pdserve/templates/NOTES.txt"]
    assert "8 prefill and 24 decode workers" in notes
    assert re.search(r"50051\s+gRPC", notes) and re.search(r"8000\s+OpenAI HTTP", notes)
