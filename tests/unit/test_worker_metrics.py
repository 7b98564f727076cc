"""Every counter a worker keeps reaches the router's /metrics, and so do its engine's step times
(`pdserve.worker.step_stats`): bucketing, aggregation, the collector's series, and a real decode
worker whose KV READs fail showing the failures."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from pdserve import LLM, SamplingParams
from pdserve.decode_worker.decoder import DecodeConfig, DecodeWorker
from pdserve.engine.hashing import block_hashes
from pdserve.kv_transfer.compat import PROTOCOL_VERSION
from pdserve.kv_transfer.transport import KvTransferError, TransferStats
from pdserve.telemetry.cluster_collector import ClusterCollector
from pdserve.worker.step_stats import BATCH_LABELS, STEP_SECONDS_BOUNDS, StepStats, batch_bucket, step_kind
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import kv_pb2, worker_pb2


def test_batch_buckets_cover_every_size_once():
    want = {1: "1", 2: "2", 3: "3-4", 4: "3-4", 5: "5-8", 8: "5-8", 9: "9-16", 16: "9-16", 17: "17-32",
            32: "17-32", 33: "33-64", 64: "33-64", 65: "65-128", 128: "65-128", 129: "129-256", 256: "129-256",
            257: "257-512", 512: "257-512", 513: "513-1024", 1024: "513-1024", 1025: "1025+", 10**6: "1025+"}
    assert {n: batch_bucket(n) for n in want} == want
    assert [batch_bucket(n) for n in range(1, 2000)] == sorted((batch_bucket(n) for n in range(1, 2000)), key=BATCH_LABELS.index)
    with pytest.raises(ValueError):
        batch_bucket(0)


def test_a_step_is_decode_prefill_or_mixed_by_its_rows():
    assert step_kind(4, 0) == "decode"
    assert step_kind(0, 3) == "prefill"
    assert step_kind(2, 1) == "mixed"
    assert step_kind(0, 0) is None


def test_step_stats_keep_a_histogram_count_sum_and_sequences_per_series():
    s = StepStats()
    s.record(4, 0, 0.0021)  # decode, 3-4
    s.record(3, 0, 0.0009)  # decode, 3-4
    s.record(1, 2, 0.040)  # mixed, 3-4
    s.record(0, 0, 5.0)  # a call that only launched a step: not a step
    s.record(0, 1, 9.0)  # prefill, 1, past the last bound
    stats = pb.WorkerStats()
    s.fill(stats)
    assert list(stats.step_seconds_bounds) == pytest.approx(STEP_SECONDS_BOUNDS)
    got = {(t.kind, t.batch): t for t in stats.step_times}
    assert set(got) == {("decode", "3-4"), ("mixed", "3-4"), ("prefill", "1")}
    d = got["decode", "3-4"]
    assert (d.count, d.sequences) == (2, 7) and d.sum_seconds == pytest.approx(0.003)
    assert len(d.bucket_counts) == len(STEP_SECONDS_BOUNDS) + 1 and sum(d.bucket_counts) == 2
    assert d.bucket_counts[STEP_SECONDS_BOUNDS.index(0.001)] == 1 and d.bucket_counts[STEP_SECONDS_BOUNDS.index(0.003)] == 1
    assert got["prefill", "1"].bucket_counts[-1] == 1  # +Inf


def _scrape(workers: list[pb.WorkerStats]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(lambda: pb.ClusterStats(workers=workers)))
    return registry


def test_the_collector_exports_step_times_as_a_histogram_and_a_sequence_counter():
    s = StepStats()
    for seconds in (0.0021, 0.0029, 0.02):
        s.record(6, 0, seconds)
    stats = pb.WorkerStats(worker_id="decode-0", role="decode")
    s.fill(stats)
    r = _scrape([stats])
    labels = {"worker": "decode-0", "kind": "decode", "batch": "5-8"}
    assert r.get_sample_value("pdserve_engine_step_seconds_count", labels) == 3
    assert r.get_sample_value("pdserve_engine_step_seconds_sum", labels) == pytest.approx(0.025)
    assert r.get_sample_value("pdserve_engine_step_seconds_bucket", {**labels, "le": "0.002"}) == 0
    assert r.get_sample_value("pdserve_engine_step_seconds_bucket", {**labels, "le": "0.003"}) == 2
    assert r.get_sample_value("pdserve_engine_step_seconds_bucket", {**labels, "le": "+Inf"}) == 3
    assert r.get_sample_value("pdserve_engine_step_sequences_total", labels) == 18
    assert b"pdserve_engine_step_seconds_bucket" in generate_latest(r)


def test_the_loop_and_overlap_counters_are_metrics_of_every_worker():
    workers = [pb.WorkerStats(worker_id=f"{role}-0", role=role, steps_launched_ahead=5 + i, loop_turns=9 + i,
                              loop_seconds=0.25 + i) for i, role in enumerate(("prefill", "decode"))]
    r = _scrape(workers)
    for i, role in enumerate(("prefill", "decode")):
        key = {"worker": f"{role}-0", "role": role}
        assert r.get_sample_value("pdserve_engine_steps_launched_ahead_total", key) == 5 + i
        assert r.get_sample_value("pdserve_engine_loop_turns_total", key) == 9 + i
        assert r.get_sample_value("pdserve_engine_loop_seconds_total", key) == 0.25 + i


def test_a_workers_collections_are_a_summary_by_generation():
    stats = pb.WorkerStats(worker_id="decode-0", role="decode", gc_collections=[40, 3, 1], gc_seconds=[0.02, 0.01, 0.3])
    r = _scrape([stats, pb.WorkerStats(worker_id="prefill-0", role="prefill")])
    key = {"worker": "decode-0", "role": "decode", "generation": "2"}
    assert r.get_sample_value("pdserve_worker_gc_pause_seconds_count", key) == 1
    assert r.get_sample_value("pdserve_worker_gc_pause_seconds_sum", key) == pytest.approx(0.3)
    assert r.get_sample_value("pdserve_worker_gc_pause_seconds_count", {**key, "generation": "0"}) == 40
    # A worker that sent none (an older one) has no series, not zeros.
    assert r.get_sample_value("pdserve_worker_gc_pause_seconds_count", {**key, "worker": "prefill-0", "role": "prefill"}) is None


def test_every_decode_counter_is_a_metric():
    fields = dict(handover_waits=1, transfer_failures=2, local_prefills=3, blocks_prefetched=4, prefetch_reads=5,
                  prefetch_expiries=6, router_lease_expiries=7)
    r = _scrape([pb.WorkerStats(worker_id="decode-0", role="decode", **fields)])
    key = {"worker": "decode-0", "role": "decode"}
    got = {name: r.get_sample_value(metric, key) for name, metric in (
        ("handover_waits", "pdserve_kv_handover_queued_total"),
        ("transfer_failures", "pdserve_kv_transfer_failures_total"),
        ("local_prefills", "pdserve_local_prefills_total"),
        ("blocks_prefetched", "pdserve_kv_blocks_prefetched_total"),
        ("prefetch_reads", "pdserve_kv_prefetch_reads_total"),
        ("prefetch_expiries", "pdserve_kv_prefetch_expiries_total"),
        ("router_lease_expiries", "pdserve_router_lease_expiries_total"),
    )}
    assert got == fields


class _BrokenLink:
    """A KV transport whose every READ fails, as a link that is down does."""

    worker_id = "decode-0"
    name = "decode-0-agent"
    compat_hash = "layout"
    block_bytes = 1

    def __init__(self) -> None:
        self.reads = 0

    def read(self, remote_agent: str, remote_ids: list[int], local_ids: list[int], notify: bytes,
             timeout_s: float) -> TransferStats:
        self.reads += 1
        raise KvTransferError("injected: connection reset")

    def notifications(self) -> list[bytes]:
        return []


def test_a_failed_kv_transfer_shows_in_metrics(tiny_model_factory):
    model_dir, hf_model = tiny_model_factory("llama")
    engine = LLM(str(model_dir), role="decode", device="cpu", dtype="float32", num_kv_blocks=64, block_size=4).engine
    link = _BrokenLink()
    worker = DecodeWorker("decode-0", engine, link, DecodeConfig(transfer_attempts=2))  # type: ignore[arg-type]
    try:
        ids = [(5 * j) % (hf_model.config.vocab_size - 1) + 1 for j in range(10)]
        hashes = block_hashes(ids, 4)
        handle = kv_pb2.KvHandle(
            protocol_version=PROTOCOL_VERSION, request_id="r0", worker_id="prefill-0", agent_name="prefill-0-agent",
            block_ids=list(range(-(-len(ids) // 4))), block_hashes=hashes, num_tokens=len(ids),
            lease_deadline=time.time() + 60, compat_hash=link.compat_hash,
        )
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        started = worker.start(ids, params, "r0", worker_pb2.PrefillResult(handle=handle, first_token=7), router_id="a")
        assert started.recomputed and started.transfer_retries == 2 and link.reads == 2
        tokens = []
        deadline = time.monotonic() + 30
        while not any(u.finish_reason for u in tokens) and time.monotonic() < deadline:
            tokens += worker.poll(1.0, "a").updates
        assert tokens and tokens[-1].finish_reason == "length"
        r = _scrape([worker.stats()])
    finally:
        worker.close()
    key = {"worker": "decode-0", "role": "decode"}
    assert r.get_sample_value("pdserve_kv_transfer_failures_total", key) == 2
    assert r.get_sample_value("pdserve_kv_transfers_total", key) == 0
    # The recomputed prompt was a prefill step on this worker, then it decoded alone.
    step = {"worker": "decode-0", "batch": "1"}
    assert r.get_sample_value("pdserve_engine_step_seconds_count", {**step, "kind": "prefill"}) >= 1
    assert r.get_sample_value("pdserve_engine_step_seconds_count", {**step, "kind": "decode"}) >= 1
    assert r.get_sample_value("pdserve_engine_step_sequences_total", {**step, "kind": "decode"}) >= 1
    # Every step ran in a loop turn that cost at least the step itself.
    steps = sum(r.get_sample_value("pdserve_engine_step_seconds_count", {**step, "kind": k}) for k in ("prefill", "decode"))
    step_s = sum(r.get_sample_value("pdserve_engine_step_seconds_sum", {**step, "kind": k}) for k in ("prefill", "decode"))
    assert r.get_sample_value("pdserve_engine_loop_turns_total", key) >= steps
    assert r.get_sample_value("pdserve_engine_loop_seconds_total", key) >= step_s > 0
    assert r.get_sample_value("pdserve_engine_steps_launched_ahead_total", key) == worker.engine.num_overlapped_steps


def test_the_engine_counts_each_steps_decode_and_prompt_rows(tiny_model_factory):
    """What the loop's timing is labelled by: a step's rows as the engine ran them."""
    model_dir, _ = tiny_model_factory("llama")
    engine = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4).engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(1, 11)), params, "a")
    engine.step()
    assert (engine.last_step_decodes, engine.last_step_prefills) == (0, 1)  # a's prompt
    engine.step()
    assert (engine.last_step_decodes, engine.last_step_prefills) == (1, 0)  # a decodes alone
    engine.add_request(list(range(20, 33)), params, "b")
    engine.step()
    assert (engine.last_step_decodes, engine.last_step_prefills) == (1, 1)  # a decodes beside b's prompt
    while engine.has_unfinished():
        engine.step()
    assert engine.step() == [] and (engine.last_step_decodes, engine.last_step_prefills) == (0, 0)  # ran nothing
