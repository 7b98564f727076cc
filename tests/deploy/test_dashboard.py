"""deploy/grafana/pdserve.json's namespace and release variables: every panel selects on both, and
its queries, with the variables filled in as Grafana does, evaluated by Prometheus's own promtool
over series of two releases and of a bare-metal router (no such labels)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_objects import REPO

from tests.promtool_path import promtool

pytestmark = pytest.mark.deploy

DASHBOARD = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
SCOPE = 'namespace=~"$namespace", release=~"$release"'
ALL = ".*"  # the variables' allValue




def exprs() -> dict[str, str]:
    """panel title / legend -> query."""
    return {f"{p['title']} / {t.get('legendFormat', t['refId'])}": t["expr"]
            for p in DASHBOARD["panels"] for t in p.get("targets", [])}


def test_variables() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    for name in ("namespace", "release"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ALL
        assert f", {name})" in v["query"]["query"]
    assert "$namespace" in variables["release"]["query"]["query"]  # releases of the chosen namespaces


def test_every_metric_in_every_panel_is_scoped() -> None:
    assert exprs()
    for where, expr in exprs().items():
        for selector in re.findall(r"pdserve_\w+(\{[^}]*\})?", expr):
            assert selector.startswith("{" + SCOPE), (where, expr)
        assert re.search(r"on \((?!namespace, release)", expr) is None, (where, expr)  # joins keep releases apart


def fill(expr: str, namespace: str, release: str) -> str:
    return expr.replace("$namespace", namespace).replace("$release", release).replace("$__rate_interval", "2m")


def series(labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items() if k != "__name__")
    return {"series": f"{labels['__name__']}{{{inner}}}", "values": values}


def kv_series(where: dict[str, str], in_use: int, capacity: int) -> list[dict[str, str]]:
    w = {**where, "worker": "decode-0", "role": "decode"}
    return [
        series({"__name__": "pdserve_kv_blocks", **w, "state": "in_use"}, f"{in_use}x5"),
        series({"__name__": "pdserve_kv_blocks", **w, "state": "free"}, f"{capacity - in_use}x5"),
        series({"__name__": "pdserve_kv_blocks_capacity", **w}, f"{capacity}x5"),
        series({"__name__": "pdserve_workers", **where, "role": "decode"}, "1x5"),
    ]


RELEASE_A = {"namespace": "serving", "release": "a", "instance": "10.0.0.1:9400"}
RELEASE_B = {"namespace": "serving", "release": "b", "instance": "10.0.0.2:9400"}
BARE = {"instance": "127.0.0.1:9400"}  # a bare-metal router: no namespace, no release


def expect(expr: str, samples: list[tuple[dict[str, str], float]]) -> dict[str, Any]:
    return {"expr": expr, "eval_time": "3m", "exp_samples": [
        {"labels": "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}", "value": value}
        for labels, value in samples
    ]}


def test_queries_select_releases_under_promtool(tmp_path: Path) -> None:
    queries = exprs()
    in_use = next(e for w, e in queries.items() if "/ on (" in e and "pdserve_kv_blocks_capacity" in e)
    by_state = next(e for e in queries.values() if e.startswith("sum by (role, state) (pdserve_kv_blocks"))
    workers = next(e for e in queries.values() if re.fullmatch(r"pdserve_workers\{[^}]*\}", e))

    def ratio(where: dict[str, str], value: float) -> tuple[dict[str, str], float]:
        # A one-to-one match `on (...)` keeps only the labels it matches on.
        kept = {k: v for k, v in where.items() if k in ("namespace", "release")}
        return {**kept, "worker": "decode-0", "role": "decode"}, value

    tests = [
        # One release chosen: only its series.
        expect(fill(in_use, "serving", "a"), [ratio(RELEASE_A, 0.25)]),
        expect(fill(by_state, "serving", "a"), [({"role": "decode", "state": "in_use"}, 2),
                                                ({"role": "decode", "state": "free"}, 6)]),
        # "All": every release and the bare-metal router, each worker's ratio apart (no many-to-many).
        expect(fill(in_use, ALL, ALL), [ratio(RELEASE_A, 0.25), ratio(RELEASE_B, 0.5), ratio(BARE, 0.75)]),
        expect(fill(workers, ALL, ALL), [({"__name__": "pdserve_workers", **w, "role": "decode"}, 1)
                                         for w in (RELEASE_A, RELEASE_B, BARE)]),
        expect(fill(workers, "other", ALL), []),
    ]
    spec = {"tests": [{
        "interval": "1m",
        "input_series": kv_series(RELEASE_A, 2, 8) + kv_series(RELEASE_B, 4, 8) + kv_series(BARE, 6, 8),
        "promql_expr_test": tests,
    }]}
    path = tmp_path / "dashboard_test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
