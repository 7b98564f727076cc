"""Tracing and metrics that every part of pdserve may use.

Nothing here is global: a process builds its `Tracing` from a `TracingConfig` and its metrics in
a `CollectorRegistry` it owns, and passes them to the objects that record.
"""

from pdserve.telemetry.context import TraceCarrier, carrier_of, context_of
from pdserve.telemetry.tracing import Tracing, TracingConfig, build_tracing

__all__ = ["TraceCarrier", "Tracing", "TracingConfig", "build_tracing", "carrier_of", "context_of"]
