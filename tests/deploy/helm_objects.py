"""Rendering the chart with the real Helm SDK (offline, no helm binary) and picking objects out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "pdserve"
RELEASE = "demo"
NAMESPACE = "serving"


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object `helm install demo -n serving` would create with these values, in file order."""
    manifests = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    for name in sorted(manifests):
        if name.endswith(".yaml"):
            objects.extend(d for d in yaml.safe_load_all(manifests[name]) if d)
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind} *{name_suffix}: {len(found)} rendered"
    return found[0]


def router_script(objects: list[dict[str, Any]]) -> str:
    """The router container's start-up script (ray start, then `exec pdserve serve ...`)."""
    container = one(objects, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/bash", "-c"]
    return container["args"][0]


def replica_script(objects: list[dict[str, Any]]) -> str:
    """The start-up script of the routers beyond the first (ray start, then `exec pdserve router ...`)."""
    container = one(objects, "Deployment", "-router-replica")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/bash", "-c"]
    return container["args"][0]


def exec_line(script: str, command: str) -> str:
    """The script's one `exec pdserve <command> ...` line."""
    lines = [ln.strip() for ln in script.splitlines() if ln.strip().startswith(f"exec pdserve {command} ")]
    assert len(lines) == 1
    return lines[0]


def serve_command(objects: list[dict[str, Any]]) -> str:
    return exec_line(router_script(objects), "serve")
