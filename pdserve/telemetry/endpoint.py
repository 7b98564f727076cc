"""Does the OTLP trace endpoint answer? Checked once when `pdserve serve` starts, so that a
collector that is not running costs one warning instead of an export error from every process."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from pdserve.telemetry.tracing import TracingConfig

# The OTLP exporters' defaults when no endpoint is given.
_DEFAULT_PORTS = {"otlp-grpc": 4317, "otlp-http": 4318}


def trace_target(cfg: TracingConfig) -> tuple[str, int] | None:
    """The host and port the trace exporter sends to; None when it sends nowhere over the network."""
    if cfg.exporter not in _DEFAULT_PORTS:
        return None
    endpoint = cfg.endpoint or "localhost"
    parts = urlsplit(endpoint if "//" in endpoint else "//" + endpoint)
    return parts.hostname or "localhost", parts.port or _DEFAULT_PORTS[cfg.exporter]


def answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when something accepts a TCP connection on host:port within timeout_s."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def unanswered_warning(cfg: TracingConfig) -> str | None:
    """The start-up warning for a trace endpoint that does not answer, or None."""
    target = trace_target(cfg)
    if target is None or answers(*target):
        return None
    host, port = target
    return (
        f"warning: the trace endpoint {host}:{port} does not answer; traces will be dropped and each process "
        "will log export errors (start an OpenTelemetry Collector there: see docs/observability.md, or leave "
        "out --trace-exporter)"
    )
