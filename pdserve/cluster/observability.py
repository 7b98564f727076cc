"""The router process's telemetry: its tracer, its metrics registry and the /metrics endpoint.

Workers' figures reach /metrics through the router: at each scrape the collector asks every
worker for its stats on the router's event loop (the same call as `Admin.GetStats`). With
`--routers N` the replicas' own series are added in (pdserve.telemetry.federation).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.cluster.serve_config import ServeConfig
from pdserve.telemetry.cluster_collector import ClusterCollector
from pdserve.telemetry.federation import FederatedCollector
from pdserve.telemetry.http import MetricsServer
from pdserve.telemetry.loop_health import GcPauses, LoopLag, freeze_heap, release_heap
from pdserve.telemetry.metrics import RouterMetrics
from pdserve.telemetry.tracing import Tracing, build_tracing

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0


class RouterTelemetry:
    def __init__(self, tracing: Tracing, metrics: RouterMetrics) -> None:
        self.tracing = tracing
        self.metrics = metrics
        self.server: MetricsServer | None = None
        # The loop's lag and the process's collections, from `watch` on (every router, with or
        # without /metrics: a replica's stalls show in its log).
        self.loop_lag = LoopLag(metrics.loop_lag)
        self.gc_pauses = GcPauses(metrics.gc_pause)
        self.frozen_objects = 0  # the start-up heap frozen out of the collector's reach (`freeze`)
        self.metric_peers: list[str] = []  # the router replicas' own /metrics, added into ours

    @classmethod
    def create(cls, cfg: ServeConfig) -> RouterTelemetry:
        return cls(build_tracing(cfg.tracing, "router"), RouterMetrics(CollectorRegistry()))

    @property
    def metrics_port(self) -> int | None:
        return None if self.server is None else self.server.port

    def serve_metrics(
        self,
        host: str,
        port: int,
        cluster_stats: Callable[[], Coroutine[Any, Any, Any]],
        loop: asyncio.AbstractEventLoop,
        worker_series: bool = True,
    ) -> int:
        """Start /metrics; `cluster_stats` is awaited on `loop` for each scrape. Returns the port.
        worker_series: the workers' own series too, not only this router's placement figures."""

        def read_stats() -> Any:
            # Runs on the HTTP server's thread: the stats call itself belongs to the router's loop.
            try:
                return asyncio.run_coroutine_threadsafe(cluster_stats(), loop).result(SCRAPE_TIMEOUT_S)
            except Exception as exc:
                log.warning("metrics scrape could not read the cluster's stats: %s", exc)
                return None

        self.metrics.registry.register(ClusterCollector(read_stats, worker_series))
        served = CollectorRegistry(auto_describe=False)
        served.register(FederatedCollector(self.metrics.registry, lambda: list(self.metric_peers)))
        self.server = MetricsServer.start(served, host, port)
        return self.server.port

    def serve_own_metrics(self, host: str = "127.0.0.1") -> int:
        """A router replica: its own series (no workers') on a loopback port of its own, which
        the first router adds into its /metrics. Returns the port."""
        self.server = MetricsServer.start(self.metrics.registry, host, 0)
        return self.server.port

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sample `loop`'s lag and time the process's collections from now on."""
        self.loop_lag.start(loop)
        self.gc_pauses.install()

    def freeze(self) -> int:
        """Once the router is up: its start-up heap out of the collector's scans (`freeze_heap`)."""
        self.frozen_objects = freeze_heap()
        log.info("router: %d start-up objects frozen out of the garbage collector's scans", self.frozen_objects)
        return self.frozen_objects

    def stop(self) -> None:
        self.loop_lag.stop()
        self.gc_pauses.remove()
        if self.frozen_objects:
            release_heap()
            self.frozen_objects = 0
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.tracing.flush()
        self.tracing.shutdown()
