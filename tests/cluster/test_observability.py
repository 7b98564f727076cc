"""Tracing and metrics of a real cluster: OTLP/gRPC export to a real receiver, and /metrics
scraped over HTTP and validated with Prometheus's own promtool."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from tests.cluster.otlp import OtlpReceiver, ReceivedSpan
from tests.promtool_path import promtool

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "Observability lets an operator see where a slow request spent its time: in the queue of a prefill "
    "worker, in computing the prompt, in moving its KV cache, or in the decode batch. Explain why.",
    "A disaggregated serving cluster splits prompt processing from token generation, so the two can "
    "scale apart; the KV cache moves between them over a fast link. Describe the trade-offs briefly.",
]
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver(otlp_receiver):
    # The traces of the shared default cluster (`cluster`, tests/cluster/conftest.py): the
    # checks below pick this module's requests by id, and its metrics by their deltas.
    return otlp_receiver


def generate(channel, rid: str, prompt: str, max_tokens: int, metadata=()) -> list[pb.GenerateResponse]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = pb.GenerateRequest(request_id=rid, prompt=prompt, sampling_params=params)
    return list(pbg.InferenceStub(channel).Generate(req, timeout=120, metadata=metadata))


def trace_of(receiver: OtlpReceiver, rid: str) -> list[ReceivedSpan]:
    spans = receiver.spans()
    roots = [s for s in spans if s.name == "pdserve.generate" and s.attributes.get("pdserve.request_id") == rid]
    if len(roots) != 1:
        return []
    return [s for s in spans if s.trace_id == roots[0].trace_id]


def test_one_trace_per_request_across_router_prefill_and_decode(loop_thread, cluster, channel, receiver, wait_until):
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    generate(channel, "traced-0", PROMPTS[0], 6, metadata=(("traceparent", traceparent),))
    generate(channel, "traced-1", PROMPTS[1], 6)
    loop_thread.run(cluster.flush_traces())
    expected = {"pdserve.generate", "pdserve.route", "pdserve.prefill", "pdserve.prefill.worker",
                "pdserve.prefill.queue", "pdserve.prefill.compute", "pdserve.decode.start", "pdserve.decode.import",
                "pdserve.kv_transfer", "pdserve.decode.first_token", "pdserve.stream"}
    for rid in ("traced-0", "traced-1"):
        wait_until(lambda: expected <= {s.name for s in trace_of(receiver, rid)}, 30, f"every span of {rid}")

    for rid in ("traced-0", "traced-1"):
        spans = trace_of(receiver, rid)
        by_name = {s.name: s for s in spans}
        assert len(by_name) == len(spans), f"a span name repeats in {rid}: {sorted(s.name for s in spans)}"
        roles = {s.resource["pdserve.role"] for s in spans}
        assert roles == {"router", "prefill", "decode"}
        assert len({s.resource["process.pid"] for s in spans}) == 3, "router, prefill and decode are three processes"

        def parent(name: str) -> str:
            ids = {s.span_id: s.name for s in spans}
            return ids.get(by_name[name].parent_span_id, "<outside>")

        root = by_name["pdserve.generate"]
        for child in ("pdserve.route", "pdserve.prefill", "pdserve.decode.start", "pdserve.decode.first_token",
                      "pdserve.stream"):
            assert parent(child) == "pdserve.generate", child
        assert parent("pdserve.prefill.worker") == "pdserve.prefill"  # crossed a Ray call
        assert parent("pdserve.prefill.queue") == parent("pdserve.prefill.compute") == "pdserve.prefill.worker"
        assert parent("pdserve.decode.import") == "pdserve.decode.start"  # crossed a Ray call
        assert parent("pdserve.kv_transfer") == "pdserve.decode.import"
        assert by_name["pdserve.prefill.worker"].resource["pdserve.role"] == "prefill"
        assert by_name["pdserve.kv_transfer"].resource["pdserve.role"] == "decode"

        route = by_name["pdserve.route"].attributes
        assert route["pdserve.prefill.worker_id"] == "prefill-0" and route["pdserve.decode.worker_id"] == "decode-0"
        assert "pdserve.prefill.matched_blocks" in route
        assert route["pdserve.prefill.local"] is False
        prompt_tokens = root.attributes["pdserve.prompt_tokens"]
        assert by_name["pdserve.prefill.compute"].attributes["pdserve.prompt_tokens"] == prompt_tokens
        assert "pdserve.cached_tokens" in by_name["pdserve.prefill.compute"].attributes
        xfer = by_name["pdserve.kv_transfer"].attributes
        assert xfer["pdserve.blocks"] == -(-prompt_tokens // 16)  # the partial last block too
        assert xfer["pdserve.bytes"] > 0
        assert xfer["pdserve.descriptors"] >= 1 and xfer["pdserve.gbps"] > 0 and xfer["pdserve.attempt"] == 1
        end = by_name["pdserve.stream"].attributes
        assert end["pdserve.completion_tokens"] == 6 and end["pdserve.finish_reason"] == "length"
        assert root.attributes["pdserve.finish_reason"] == "length"

    # The client's traceparent is honoured: the request's trace continues the caller's.
    root0 = next(s for s in trace_of(receiver, "traced-0") if s.name == "pdserve.generate")
    assert root0.trace_id == CLIENT_TRACE_ID and root0.parent_span_id == CLIENT_SPAN_ID
    root1 = next(s for s in trace_of(receiver, "traced-1") if s.name == "pdserve.generate")
    assert root1.trace_id != CLIENT_TRACE_ID and root1.parent_span_id == ""


def scrape(cluster) -> str:
    with urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=30) as resp:
        assert resp.status == 200
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(snapshot: dict, name: str, **labels: str) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_pass_promtool_and_count_known_requests(cluster, channel):
    before = samples(scrape(cluster))
    outs = [generate(channel, f"metered-{i}", p + " Once more.", 5) for i, p in enumerate(PROMPTS)]
    text = scrape(cluster)
    after = samples(text)

    check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = [line for line in (check.stdout + check.stderr).splitlines() if "pdserve_" in line]
    assert check.returncode in (0, 3), check.stdout + check.stderr  # 3: lint findings, judged below
    assert not problems, "\n".join(problems)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt_tokens = sum(o[-1].usage.prompt_tokens for o in outs)
    assert delta("pdserve_requests_total", outcome="length") == 2
    assert delta("pdserve_generation_tokens_total") == 10
    assert delta("pdserve_prompt_tokens_total") == prompt_tokens
    assert delta("pdserve_time_to_first_token_seconds_count") == 2
    assert delta("pdserve_request_duration_seconds_count") == 2
    assert delta("pdserve_inter_token_latency_seconds_count") == 8
    assert delta("pdserve_kv_transfer_duration_seconds_count") == 2
    assert delta("pdserve_prefill_queue_seconds_count") == 2  # reported by the prefill worker
    assert delta("pdserve_prefill_queue_seconds_sum") <= delta("pdserve_prefill_duration_seconds_sum")
    # The call's parts, each reported once a call, add up to the router's wait (rounding aside).
    parts = ["pdserve_prefill_queue_seconds_sum", "pdserve_prefill_compute_seconds_sum"]
    assert delta("pdserve_prefill_compute_seconds_count") == 2 and delta(parts[1]) > 0
    for part in ("worker", "transport"):
        assert delta("pdserve_prefill_overhead_seconds_count", part=part) == 2
    whole = sum(delta(p) for p in parts) + sum(
        delta("pdserve_prefill_overhead_seconds_sum", part=part) for part in ("worker", "transport"))
    assert whole == pytest.approx(delta("pdserve_prefill_duration_seconds_sum"), abs=0.01)
    # On one host the transport's way there and way back, by the two wall clocks, make up the transport.
    legs = [delta("pdserve_prefill_overhead_seconds_sum", part=part) for part in ("send", "reply")]
    assert all(delta("pdserve_prefill_overhead_seconds_count", part=part) == 2 for part in ("send", "reply"))
    assert sum(legs) == pytest.approx(delta("pdserve_prefill_overhead_seconds_sum", part="transport"), abs=0.005)
    assert delta("pdserve_kv_transfer_bytes_total") > 0
    assert delta("pdserve_prefills_total", location="remote") == 2  # disaggregated: no prompt prefilled locally
    assert delta("pdserve_prefills_total", location="local") == 0
    assert value(after, "pdserve_requests_in_flight") == 0
    assert value(after, "pdserve_router_event_loop_lag_seconds_count") > 0  # sampled while /metrics is served
    assert value(after, "pdserve_kv_link_test_bytes_per_second", decode="decode-0", prefill="prefill-0") > 0

    # Workers' figures, read through the router at scrape time.
    for worker, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert value(after, "pdserve_worker_up", worker=worker, role=role) == 1
        states = [value(after, "pdserve_kv_blocks", worker=worker, role=role, state=s) for s in ("free", "cached", "in_use")]
        assert sum(states) == value(after, "pdserve_kv_blocks_capacity", worker=worker, role=role) > 0
    assert value(after, "pdserve_workers", role="prefill") == value(after, "pdserve_workers", role="decode") == 1
    assert delta("pdserve_kv_transfers_total", worker="decode-0", role="decode") == 2
    assert delta("pdserve_placed_requests_total", pool="prefill", worker="prefill-0") == 2


def test_dashboard_queries_only_metrics_the_cluster_exposes(cluster, channel):
    import json
    import re

    generate(channel, "dashboard-0", PROMPTS[0], 3)  # so every histogram has samples
    exposed = {s[0] for s in samples(scrape(cluster))}
    exposed |= {re.sub(r"_(bucket|count|sum)$", "", n) for n in exposed}
    dashboard = json.loads((ROOT / "deploy/grafana/pdserve.json").read_text())
    used = {name for p in dashboard["panels"] for t in p["targets"] for name in re.findall(r"pdserve_\w+", t["expr"])}
    assert used and used <= exposed, sorted(used - exposed)


def test_the_router_and_every_worker_freeze_their_start_up_heap_out_of_the_collectors_scans(cluster):
    """A full collection stops every thread of a process; once up, the router (`start_edge`) and
    each worker actor (its `__init__`) leave their start-up objects out of those scans."""
    import gc

    import ray

    # The router froze this process's heap (`gc.get_freeze_count()` itself is not read here: in this
    # test process another cluster's router, stopping, hands the whole process's heap back).
    assert cluster.telemetry.frozen_objects > 0
    frozen = ray.get([a.__ray_call__.remote(lambda _: gc.get_freeze_count()) for a in cluster.actors], timeout=60)
    assert len(frozen) >= 2 and all(n > 0 for n in frozen), frozen


def test_a_workers_full_collection_shows_on_the_routers_metrics(cluster):
    """Workers serve no /metrics of their own: their process's collections come with their stats.
    A full collection forced in one worker actor is counted, with its pause, for that worker."""
    import gc

    import ray

    actor = cluster.actors[0]
    worker = ray.get(actor.identity.remote(), timeout=60)["worker_id"]

    def full_gcs() -> float:
        snapshot = samples(scrape(cluster))
        return sum(v for (name, labels), v in snapshot.items() if name == "pdserve_worker_gc_pause_seconds_count"
                   and ("worker", worker) in labels and ("generation", "2") in labels)  # fmt: skip

    before = full_gcs()
    ray.get(actor.__ray_call__.remote(lambda _: gc.collect(2)), timeout=60)
    assert full_gcs() == before + 1
    paused = sum(v for (name, labels), v in samples(scrape(cluster)).items()
                 if name == "pdserve_worker_gc_pause_seconds_sum" and ("worker", worker) in labels)  # fmt: skip
    assert paused > 0

