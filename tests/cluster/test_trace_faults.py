"""Telemetry on the failure paths, with real workers in this process (real engines, real NIXL):
a KV READ that fails is a span with status ERROR followed by the retry that worked, and the
metrics count the retry and each outcome. The tracer is the test's own provider, handed to the
router and the workers as any caller would."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.router.handles import RouterError
from pdserve.router.router import Router
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2 as pb

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def traced(start_shared_in_process, faulty_transport):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    metrics = RouterMetrics()
    c = start_shared_in_process(
        tracer=tracer, metrics=metrics, serve=False, wrap_transport=lambda t: faulty_transport(t, fail_reads=1)
    )
    yield c.router, exporter, metrics
    c.close()
    provider.shutdown()


def run(loop_thread, router: Router, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async def collect() -> list[pb.GenerateResponse]:
        return [chunk async for chunk in router.generate(request)]

    return loop_thread.run(collect(), timeout=120)


def test_a_failed_read_is_an_error_span_then_the_retry(loop_thread, traced):
    router, exporter, metrics = traced
    req = pb.GenerateRequest(request_id="retried", prompt_token_ids=list(range(300, 340)), sampling_params=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    chunks = run(loop_thread, router, req)
    assert chunks[-1].finish_reason == "length"
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "pdserve.generate" and s.attributes["pdserve.request_id"] == "retried")
    mine = [s for s in spans if s.context.trace_id == root.context.trace_id]
    transfers = sorted((s for s in mine if s.name == "pdserve.kv_transfer"), key=lambda s: s.attributes["pdserve.attempt"])
    assert [s.attributes["pdserve.attempt"] for s in transfers] == [1, 2]
    assert transfers[0].status.status_code == trace.StatusCode.ERROR
    assert "injected transfer failure" in transfers[0].status.description
    assert transfers[1].status.status_code != trace.StatusCode.ERROR and transfers[1].attributes["pdserve.bytes"] > 0
    imported = next(s for s in mine if s.name == "pdserve.decode.import")
    assert all(t.parent.span_id == imported.context.span_id for t in transfers)
    assert imported.attributes["pdserve.recomputed"] is False
    assert metrics.registry.get_sample_value("pdserve_kv_transfer_retries_total") == 1
    assert metrics.registry.get_sample_value("pdserve_kv_recomputes_total") == 0


def test_failures_are_counted_by_status_and_the_root_span_says_why(loop_thread, traced):
    router, exporter, metrics = traced
    bad = pb.GenerateRequest(request_id="bad", prompt_token_ids=[10**9], sampling_params=pb.SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(RouterError):
        run(loop_thread, router, bad)
    value = metrics.registry.get_sample_value
    assert value("pdserve_requests_total", {"outcome": "invalid_argument"}) == 1
    assert value("pdserve_requests_in_flight") == 0
    root = [s for s in exporter.get_finished_spans() if s.name == "pdserve.generate"][-1]
    assert root.status.status_code == trace.StatusCode.ERROR
    assert root.status.description.startswith("INVALID_ARGUMENT: prompt_token_ids")
