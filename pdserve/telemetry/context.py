"""W3C trace context as a plain dict, so it crosses Ray calls as an argument and gRPC as metadata."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# `traceparent` / `tracestate` header names and values; empty when the span is not recording.
TraceCarrier = dict[str, str]

_W3C = TraceContextTextMapPropagator()  # stateless: holds no context, only the format


def carrier_of(span: trace.Span) -> TraceCarrier:
    """The headers that make a remote span a child of `span` ({} for a non-recording span, so
    tracing that is off sends nothing)."""
    if not span.get_span_context().is_valid:
        return {}
    carrier: TraceCarrier = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def context_of(carrier: Mapping[str, str] | None) -> Context | None:
    """The parent context carried by `carrier` (None when it carries none)."""
    if not carrier:
        return None
    lowered = {k.lower(): v for k, v in carrier.items()}  # gRPC metadata keys arrive lower-case anyway
    if "traceparent" not in lowered:
        return None
    return _W3C.extract(lowered)
