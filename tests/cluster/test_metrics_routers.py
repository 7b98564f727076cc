"""Three routers in front of one fleet, as the Helm chart runs them: the first (`pdserve serve`'s
code path) exports the workers' series, the two that join it (`pdserve router`'s, in this process:
the same Ray driver) run with `export_worker_metrics=False`. Each scrape passes promtool, and over
the three scrapes every worker series appears exactly once, with the values one router alone shows."""

from __future__ import annotations

import subprocess
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.join import JoinedRouter
from tests.promtool_path import promtool

pytestmark = pytest.mark.cluster

# Series that come from the workers (the same from every router), as opposed to a router's own.
WORKER_FAMILIES = ("pdserve_worker_up", "pdserve_workers", "pdserve_kv_blocks", "pdserve_kv_blocks_capacity",
                   "pdserve_worker_requests", "pdserve_preemptions")


@pytest.fixture(scope="module")
def routers(loop_thread: Any, cluster: Any) -> Iterator[list[str]]:
    """The first router is the conftest's cluster's (1 prefill + 1 decode, with /metrics)."""
    assert cluster.metrics_address is not None
    joined: list[JoinedRouter] = []
    try:
        for _ in range(2):
            join_cfg = replace(cluster.cfg, port=0, http_port=None, metrics_port=0, export_worker_metrics=False)
            joined.append(loop_thread.run(JoinedRouter.start(join_cfg), timeout=120))
        urls = [f"http://{cluster.metrics_address}/metrics"]
        urls += [f"http://127.0.0.1:{j.telemetry.metrics_port}/metrics" for j in joined]
        yield urls
    finally:
        for j in joined:
            loop_thread.run(j.stop(), timeout=60)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        return resp.read().decode()


def _worker_series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name in WORKER_FAMILIES
        for s in family.samples
    }


def test_three_routers_export_each_worker_series_once(routers: list[str]) -> None:
    texts = [_scrape(url) for url in routers]
    for text in texts:
        check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60, check=False)
        assert check.returncode in (0, 3), check.stdout + check.stderr  # 3: lint findings, judged below
        problems = [ln for ln in (check.stdout + check.stderr).splitlines() if "pdserve_" in ln]
        assert not problems, "\n".join(problems)
    per_router = [_worker_series(t) for t in texts]
    first, others = per_router[0], per_router[1:]
    workers = {dict(labels)["worker"] for (name, labels) in first if name == "pdserve_worker_up"}
    assert workers == {"prefill-0", "decode-0"}
    assert all(series == {} for series in others), [sorted(s)[:3] for s in others]
    counts = Counter(key for series in per_router for key in series)
    assert counts and set(counts.values()) == {1}  # each worker series once over the three scrapes
    # Every router still shows its own figures (placement, requests).
    for text in texts:
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"pdserve_placed_requests", "pdserve_requests"} <= names
