"""The decode workers' checksum failures reach Prometheus through the router's scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.telemetry.cluster_collector import ClusterCollector
from pdserve_proto import inference_pb2 as pb


def test_checksum_failures_are_a_counter_per_decode_worker():
    stats = pb.ClusterStats(
        workers=[
            pb.WorkerStats(worker_id="prefill-0", role="prefill"),
            pb.WorkerStats(worker_id="decode-0", role="decode", transfers=5, checksum_failures=2),
            pb.WorkerStats(worker_id="decode-1", role="decode"),
        ]
    )
    registry = CollectorRegistry()
    registry.register(ClusterCollector(lambda: stats))
    got = registry.get_sample_value
    assert got("pdserve_kv_checksum_failures_total", {"worker": "decode-0", "role": "decode"}) == 2
    assert got("pdserve_kv_checksum_failures_total", {"worker": "decode-1", "role": "decode"}) == 0
    assert got("pdserve_kv_checksum_failures_total", {"worker": "prefill-0", "role": "prefill"}) is None
