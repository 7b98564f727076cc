"""Telemetry without a cluster: configuration from the OTEL_* variables, W3C context round trips,
OTLP/HTTP export to a real HTTP receiver, and the workers' metrics built from cluster stats."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.telemetry.cluster_collector import ClusterCollector
from pdserve.telemetry.context import carrier_of, context_of
from pdserve.telemetry.tracing import TracingConfig, build_tracing
from pdserve_proto import inference_pb2 as pb


def test_tracing_is_off_by_default_and_costs_a_no_op_tracer():
    cfg = TracingConfig.from_env({})
    assert cfg == TracingConfig() and not cfg.enabled
    tracing = build_tracing(cfg, "router")
    assert tracing.provider is None and isinstance(tracing.tracer, trace.NoOpTracer)
    span = tracing.tracer.start_span("x")
    assert not span.is_recording() and carrier_of(span) == {}


@pytest.mark.parametrize(
    "env, exporter, endpoint, ratio",
    [
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp-grpc", None, 1.0),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "otlp-grpc", "http://c:4317", 1.0),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
             "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"},
            "otlp-http", "http://c:4318/v1/traces", 1.0,
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/x"},
            "otlp-http", "http://c:9/x", 1.0,
        ),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
          "OTEL_TRACES_SAMPLER_ARG": "0.25"}, "console", None, 0.25),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "always_off"}, "console", None, 0.0),
    ],
)
def test_config_follows_the_standard_environment_variables(env, exporter, endpoint, ratio):
    cfg = TracingConfig.from_env(env)
    assert (cfg.exporter, cfg.endpoint, cfg.sample_ratio) == (exporter, endpoint, ratio)


def test_flags_override_the_environment_and_bad_values_name_the_setting():
    cfg = TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "console"}).overridden("otlp-grpc", "127.0.0.1:4317", 0.5)
    assert (cfg.exporter, cfg.endpoint, cfg.sample_ratio) == ("otlp-grpc", "127.0.0.1:4317", 0.5)
    with pytest.raises(ValueError, match="trace_exporter"):
        TracingConfig(exporter="jaeger")
    with pytest.raises(ValueError, match="trace_sample_ratio"):
        TracingConfig(sample_ratio=1.5)
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_trace_context_round_trips_through_a_plain_dict():
    tracer = TracerProvider().get_tracer("t")
    parent = tracer.start_span("parent")
    carrier = carrier_of(parent)
    assert set(carrier) == {"traceparent"}
    child = tracer.start_span("child", context=context_of({k.upper(): v for k, v in carrier.items()}))
    assert child.parent.span_id == parent.get_span_context().span_id
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    assert context_of(None) is None and context_of({"other": "x"}) is None


class _OtlpHttp(BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        type(self).received.append((self.path, self.headers["Content-Type"], req))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_otlp_http_exports_spans_with_the_process_role():
    _OtlpHttp.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        tracing = build_tracing(TracingConfig("otlp-http", endpoint, export_delay_s=0.05), "prefill", "prefill-3")
        tracing.tracer.start_span("pdserve.test", attributes={"pdserve.n": 7}).end()
        assert tracing.flush(10)
        tracing.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    path, content_type, req = _OtlpHttp.received[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    resource = {a.key: a.value for a in req.resource_spans[0].resource.attributes}
    assert resource["pdserve.role"].string_value == "prefill"
    assert resource["pdserve.worker_id"].string_value == "prefill-3"
    span = req.resource_spans[0].scope_spans[0].spans[0]
    assert span.name == "pdserve.test" and span.attributes[0].value.int_value == 7


def test_cluster_collector_reports_each_worker_and_marks_the_unreachable():
    stats = pb.ClusterStats()
    stats.workers.add(worker_id="prefill-0", role="prefill", kv_blocks_total=10, kv_blocks_free=6, kv_blocks_cached=3,
                      kv_blocks_in_use=1, lease_expiries=2, preemptions=1)
    stats.workers.add(worker_id="decode-0", role="decode", kv_blocks_total=8, kv_blocks_free=8, transfers=4,
                      bytes_pulled=4096, blocks_pulled=12)
    stats.workers.add(worker_id="decode-1", role="unreachable")
    stats.placement.add(pool="prefill", hit_rate=0.5, placed={"prefill-0": 9})
    registry = CollectorRegistry()
    registry.register(ClusterCollector(lambda: stats))
    got = registry.get_sample_value
    assert got("pdserve_worker_up", {"worker": "decode-1", "role": "decode"}) == 0
    assert got("pdserve_worker_up", {"worker": "prefill-0", "role": "prefill"}) == 1
    assert got("pdserve_workers", {"role": "decode"}) == 2
    assert got("pdserve_kv_blocks", {"worker": "prefill-0", "role": "prefill", "state": "cached"}) == 3
    assert got("pdserve_lease_expiries_total", {"worker": "prefill-0", "role": "prefill"}) == 2
    assert got("pdserve_kv_pulled_bytes_total", {"worker": "decode-0", "role": "decode"}) == 4096
    assert got("pdserve_prefix_hit_ratio", {"pool": "prefill"}) == 0.5
    assert got("pdserve_placed_requests_total", {"pool": "prefill", "worker": "prefill-0"}) == 9

    empty = CollectorRegistry()
    empty.register(ClusterCollector(lambda: None))  # stats unreadable: the scrape still answers
    assert b"pdserve_worker_up" not in generate_latest(empty)
