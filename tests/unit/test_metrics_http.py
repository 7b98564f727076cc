"""The /metrics endpoint's HTTP server: it serves the registry on loopback (IPv4 and, where the
host has it, IPv6), and its start makes no DNS lookup: `socket.getfqdn` is replaced by one that
fails the test (a stand-in for an unreachable resolver, where the lookup held the start for 10 s)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve.telemetry.http import MetricsServer


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("pdserve_probe", "A counter for the test.", registry=registry).inc(3)
    return registry


@pytest.fixture
def no_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> str:
        raise AssertionError(f"the metrics server looked up a name: getfqdn{args}")

    monkeypatch.setattr(socket, "getfqdn", refuse)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_it_serves_the_registry_on_loopback_without_a_lookup(no_dns: None) -> None:
    server = MetricsServer.start(_registry(), "127.0.0.1", 0)
    try:
        assert server.port > 0
        assert "pdserve_probe_total 3.0" in _scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    with pytest.raises(OSError):
        _scrape(f"http://127.0.0.1:{server.port}/metrics")  # stopped: nothing listens


def test_an_ipv6_address_gets_an_ipv6_socket(no_dns: None) -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this host has no IPv6 loopback")
    server = MetricsServer.start(_registry(), "::1", 0)
    try:
        assert "pdserve_probe_total 3.0" in _scrape(f"http://[::1]:{server.port}/metrics")
    finally:
        server.stop()
