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

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.workers import build_decode, build_prefill
from pdserve.engine.config import ModelConfig
from pdserve.models.default_model import default_model_dir
from pdserve.engine.detokenizer import load_tokenizer
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2 as pb
from router.handles import RouterError
from router.local_handles import LocalDecode, LocalPrefill
from router.router import Router, RouterConfig
from tests.cluster.conftest import greedy

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def traced(loop_thread):
    model_dir = default_model_dir()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128, inject_read_failures=1)
    prefill, decode = build_prefill("prefill-0", cfg, tracer), build_decode("decode-0", cfg, tracer)
    decode.agent.connect(prefill.agent.info())
    prefill.agent.connect(decode.agent.info())
    mc = ModelConfig.from_dir(model_dir)
    rc = RouterConfig(model_id=model_dir.name, max_model_len=mc.max_model_len, vocab_size=mc.vocab_size)
    metrics = RouterMetrics()
    router = Router(rc, load_tokenizer(model_dir), [LocalPrefill(prefill)], [LocalDecode(decode)], tracer, metrics)
    loop_thread.run(router.start())
    yield router, exporter, metrics
    loop_thread.run(router.stop())
    prefill.close()
    decode.close()
    provider.shutdown()


def run(loop_thread, router: Router, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async def collect() -> list[pb.GenerateResponse]:
        return [chunk async for chunk in router.generate(request)]

    return loop_thread.run(collect(), timeout=120)


def test_a_failed_read_is_an_error_span_then_the_retry(loop_thread, traced):
    router, exporter, metrics = traced
    req = pb.GenerateRequest(request_id="retried", prompt_token_ids=list(range(300, 340)), sampling_params=greedy(4, ignore_eos=True))
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
    bad = pb.GenerateRequest(request_id="bad", prompt_token_ids=[10**9], sampling_params=greedy(4))
    with pytest.raises(RouterError):
        run(loop_thread, router, bad)
    value = metrics.registry.get_sample_value
    assert value("pdserve_requests_total", {"outcome": "invalid_argument"}) == 1
    assert value("pdserve_requests_in_flight") == 0
    root = [s for s in exporter.get_finished_spans() if s.name == "pdserve.generate"][-1]
    assert root.status.status_code == trace.StatusCode.ERROR
    assert root.status.description.startswith("INVALID_ARGUMENT: prompt_token_ids")
