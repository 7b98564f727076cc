"""`--export-worker-metrics`: with several routers in front of one fleet, only one puts the workers'
series on its /metrics (each router's own placement figures stay on every router), so a scrape of
all the routers counts each worker once. The cluster test with three real routers is
tests/cluster/test_metrics_routers.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli import _build_parser
from pdserve.cluster.main import router_config_from_args
from pdserve.telemetry.cluster_collector import ClusterCollector
from pdserve_proto import inference_pb2 as pb

STATS = pb.ClusterStats(
    workers=[
        pb.WorkerStats(worker_id="prefill-0", role="prefill", kv_blocks_total=8, kv_blocks_free=8),
        pb.WorkerStats(worker_id="decode-0", role="decode", kv_blocks_total=8, kv_blocks_free=6, kv_blocks_in_use=2),
    ],
    placement=[pb.PlacementStats(pool="decode", hit_rate=0.5, placed={"decode-0": 3})],
)


def _families(worker_series: bool) -> set[str]:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(lambda: STATS, worker_series))
    return {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_the_switch_keeps_placement_and_drops_worker_series() -> None:
    on, off = _families(True), _families(False)
    assert off == {"pdserve_prefix_hit_ratio", "pdserve_placed_requests"}
    assert off < on
    assert {"pdserve_worker_up", "pdserve_workers", "pdserve_kv_blocks", "pdserve_kv_blocks_capacity"} <= on - off


def test_the_flag_on_both_commands() -> None:
    parser = _build_parser()
    for command in ("serve", "router"):
        extra = ["--address", "10.0.0.1:6379"] if command == "router" else []
        assert parser.parse_args([command, *extra]).export_worker_metrics is True
        args = parser.parse_args([command, *extra, "--no-export-worker-metrics"])
        assert args.export_worker_metrics is False
    args = parser.parse_args(["router", "--address", "10.0.0.1:6379", "--no-export-worker-metrics"])
    assert router_config_from_args(args).export_worker_metrics is False
