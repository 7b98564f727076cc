"""The /metrics endpoint: prometheus-client's HTTP server over one registry, stoppable."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return self._server.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
        """Serve `registry` on http://host:port/metrics (port 0 picks a free one)."""
        server, thread = start_http_server(port, addr=host, registry=registry)
        return cls(server, thread)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
