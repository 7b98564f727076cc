"""One /metrics for `--routers N` (pdserve/telemetry/federation.py): the first router's registry
with the replicas' series added in. Real registries (the router's own `RouterMetrics`), real
exposition text over a real loopback /metrics server, and the merged output through promtool."""

from __future__ import annotations

import logging
import subprocess

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.telemetry.federation import FederatedCollector, merge_families, parse_samples
from pdserve.telemetry.http import MetricsServer
from pdserve.telemetry.metrics import RouterMetrics
from tests.promtool_path import promtool


def _router(requests: int, in_flight: int, ttft_s: float, workers: int) -> RouterMetrics:
    m = RouterMetrics(CollectorRegistry())
    m.requests.labels("length").inc(requests)
    m.in_flight.set(in_flight)
    for _ in range(requests):
        m.ttft.observe(ttft_s)
    m.pool_workers.labels("decode").set(workers)
    return m


def _value(text: str, series: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(series + " ")]
    return float(line.rsplit(" ", 1)[1])


def _served(first: RouterMetrics, *peers: str) -> str:
    served = CollectorRegistry(auto_describe=False)
    served.register(FederatedCollector(first.registry, lambda: list(peers)))
    return generate_latest(served).decode()


def test_counters_and_histograms_add_up_over_routers_and_gauges_stay_the_first_router_s():
    first, replica = _router(3, 1, 0.05, 2), _router(5, 2, 0.5, 7)
    server = MetricsServer.start(replica.registry, "127.0.0.1", 0)  # the replica's own series, on loopback
    try:
        text = _served(first, f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    assert _value(text, 'pdserve_requests_total{outcome="length"}') == 8
    assert _value(text, "pdserve_time_to_first_token_seconds_count") == 8
    assert abs(_value(text, "pdserve_time_to_first_token_seconds_sum") - (3 * 0.05 + 5 * 0.5)) < 1e-9
    assert _value(text, 'pdserve_time_to_first_token_seconds_bucket{le="0.1"}') == 3  # the replica's were slower
    assert _value(text, 'pdserve_time_to_first_token_seconds_bucket{le="+Inf"}') == 8
    assert _value(text, "pdserve_requests_in_flight") == 3  # additive: requests in flight on either router
    assert _value(text, 'pdserve_pool_workers{role="decode"}') == 2  # the cluster's figure: the first router's
    created = [line for line in text.splitlines() if line.startswith('pdserve_requests_created{outcome="length"}')]
    assert len(created) == 1  # one series, the earlier of the two
    check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60,
                           check=False)  # fmt: skip
    problems = [line for line in (check.stdout + check.stderr).splitlines() if "pdserve_" in line]
    assert check.returncode in (0, 3) and not problems, check.stdout + check.stderr


def test_a_label_only_a_replica_has_seen_joins_its_family():
    first, replica = _router(1, 0, 0.05, 1), _router(1, 0, 0.05, 1)
    replica.requests.labels("RESOURCE_EXHAUSTED").inc(4)
    replica.local_submit.labels("send").observe(0.002)
    merged = merge_families(first.registry.collect(), [parse_samples(generate_latest(replica.registry).decode())])
    text = generate_latest(_Fixed(merged)).decode()
    assert _value(text, 'pdserve_requests_total{outcome="RESOURCE_EXHAUSTED"}') == 4
    assert _value(text, 'pdserve_local_prefill_submit_seconds_count{part="send"}') == 1
    assert text.count("# TYPE pdserve_requests_total counter") == 1


def test_a_replica_that_does_not_answer_is_left_out_with_one_warning(caplog):
    first = _router(2, 0, 0.05, 1)
    caplog.set_level(logging.WARNING, logger="pdserve.telemetry.federation")
    dead = "http://127.0.0.1:9/metrics"  # discard port: nothing listens
    served = CollectorRegistry(auto_describe=False)
    served.register(FederatedCollector(first.registry, lambda: [dead]))
    for _ in range(3):  # scrapes a few seconds apart: one warning a minute
        text = generate_latest(served).decode()
        assert _value(text, 'pdserve_requests_total{outcome="length"}') == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and dead in warnings[0] and "left out of this scrape" in warnings[0]


def test_without_replicas_the_exposition_is_the_registry_s_own():
    first = _router(2, 1, 0.05, 3)
    assert _served(first).splitlines() == [
        line for line in generate_latest(first.registry).decode().splitlines()
    ]  # fmt: skip


class _Fixed:
    """A registry-like holder of already-merged families, for generate_latest."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)
