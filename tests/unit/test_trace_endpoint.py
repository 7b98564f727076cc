"""The start-up check of the OTLP trace endpoint."""

from __future__ import annotations

import socket

from pdserve.telemetry.endpoint import answers, trace_target, unanswered_warning
from pdserve.telemetry.tracing import TracingConfig


def test_trace_target_follows_the_exporters_defaults():
    assert trace_target(TracingConfig("none")) is None
    assert trace_target(TracingConfig("console")) is None
    assert trace_target(TracingConfig("otlp-grpc")) == ("localhost", 4317)
    assert trace_target(TracingConfig("otlp-grpc", "127.0.0.1:14317")) == ("127.0.0.1", 14317)
    assert trace_target(TracingConfig("otlp-grpc", "http://collector:4317")) == ("collector", 4317)
    assert trace_target(TracingConfig("otlp-http")) == ("localhost", 4318)
    assert trace_target(TracingConfig("otlp-http", "http://10.0.0.5:9000/v1/traces")) == ("10.0.0.5", 9000)


def test_a_silent_endpoint_gets_one_warning_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: nothing answers
        assert not answers("127.0.0.1", port)
        warning = unanswered_warning(TracingConfig("otlp-grpc", f"127.0.0.1:{port}"))
    assert warning is not None and f"127.0.0.1:{port} does not answer" in warning
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert unanswered_warning(TracingConfig("otlp-grpc", f"127.0.0.1:{s.getsockname()[1]}")) is None
    assert unanswered_warning(TracingConfig("none")) is None
