"""The /metrics endpoint: prometheus-client's WSGI app over one registry, on a threading HTTP
server of its own that starts without a DNS lookup, stoppable."""

from __future__ import annotations

import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _Server(ThreadingWSGIServer):
    """prometheus-client's threading server, less the reverse DNS lookup of the bound address
    that `HTTPServer.server_bind` makes (`socket.getfqdn`): behind an unreachable resolver it
    held the start for 10 s, for a name nothing reads."""

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port
        self.setup_environ()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """A scrape is not worth a log line."""


class MetricsServer:
    """A running /metrics endpoint; `stop` ends it."""

    def __init__(self, server: _Server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return self._server.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
        """Serve `registry` on http://host:port/metrics (port 0 picks a free one)."""
        # The family of `host` (an IPv6 address needs AF_INET6); a literal address is not looked up.
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsHTTPServer", (_Server,), {"address_family": family})
        server = make_server(sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        return cls(server, thread)

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
