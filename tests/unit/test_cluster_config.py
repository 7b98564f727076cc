"""Cluster configuration: CPU workers on one host share its cores instead of each taking all of
them; pool sizes (a colocated cluster has no prefill pool) and the flags of `pdserve serve`."""

from __future__ import annotations

import pytest

from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.workers import cpu_threads_per_worker


def test_cores_are_shared_out_among_the_workers_with_one_left_to_the_router():
    assert cpu_threads_per_worker(ServeConfig(num_prefill=1, num_decode=1), cores=2) == 1
    assert cpu_threads_per_worker(ServeConfig(num_prefill=2, num_decode=2), cores=16) == 3  # 15 cores for 4
    assert cpu_threads_per_worker(ServeConfig(num_prefill=1, num_decode=1), cores=8) == 3
    assert cpu_threads_per_worker(ServeConfig(num_prefill=2, num_decode=3), cores=2) == 1  # never zero


def test_a_lone_colocated_worker_leaves_a_core_to_the_router():
    assert cpu_threads_per_worker(ServeConfig(num_prefill=0, num_decode=1), cores=2) == 1
    assert cpu_threads_per_worker(ServeConfig(num_prefill=0, num_decode=1), cores=8) == 7
    assert cpu_threads_per_worker(ServeConfig(num_prefill=0, num_decode=1), cores=1) == 1


def test_an_explicit_thread_count_wins():
    assert cpu_threads_per_worker(ServeConfig(cpu_threads_per_worker=3), cores=2) == 3


def test_no_prefill_pool_is_a_colocated_cluster_but_a_decode_pool_is_required():
    assert ServeConfig(num_prefill=0, num_decode=2).num_prefill == 0
    assert cpu_threads_per_worker(ServeConfig(num_prefill=0, num_decode=2), cores=2) == 1
    with pytest.raises(ValueError, match="^num_decode:"):
        ServeConfig(num_prefill=1, num_decode=0)
    with pytest.raises(ValueError, match="^num_decode:"):
        ServeConfig(num_prefill=0, num_decode=0)
    with pytest.raises(ValueError, match="^num_prefill:"):
        ServeConfig(num_prefill=-1)


def test_the_serve_command_maps_colocation_and_the_local_prefill_threshold():
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args

    args = _build_parser().parse_args(["serve", "--prefill", "0", "--decode", "2", "--max-local-prefill-tokens", "256"])
    cfg = config_from_args(args)
    assert (cfg.num_prefill, cfg.num_decode, cfg.placement.max_local_prefill_tokens) == (0, 2, 256)
    assert config_from_args(_build_parser().parse_args(["serve"])).placement.max_local_prefill_tokens == 0


def test_the_overflow_flags_reach_the_router_the_engines_and_a_joining_router():
    from pdserve.cli import _build_parser
    from pdserve.cluster.join import router_config
    from pdserve.cluster.main import config_from_args
    from pdserve_proto import worker_pb2

    flags = ["serve", "--max-prefill-queue-tokens", "8192", "--max-prefill-tokens-with-decodes", "256"]
    cfg = config_from_args(_build_parser().parse_args(flags))
    assert cfg.placement.max_prefill_queue_tokens == 8192 and cfg.engine.max_prefill_tokens_with_decodes == 256
    default = config_from_args(_build_parser().parse_args(["serve"]))
    assert default.placement.max_prefill_queue_tokens == 0 and default.engine.max_prefill_tokens_with_decodes is None
    info = worker_pb2.ServeInfo(model_dir="/m/x", max_model_len=64, vocab_size=100, block_size=16,
                                placement_policy="index", load_factor=1.25, max_prefill_queue_tokens=8192)
    assert router_config(info, 0).placement.max_prefill_queue_tokens == 8192
    with pytest.raises(ValueError, match="^max_prefill_tokens_with_decodes:"):
        config_from_args(_build_parser().parse_args(["serve", "--max-prefill-tokens-with-decodes", "0"]))


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf"])
def test_the_itl_target_reaches_the_engines_and_refuses_what_is_not_a_time(bad):
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args

    assert config_from_args(_build_parser().parse_args(["serve", "--itl-target-ms", "10.5"])).engine.itl_target_ms == 10.5
    assert config_from_args(_build_parser().parse_args(["serve"])).engine.itl_target_ms is None
    with pytest.raises(ValueError, match="^itl_target_ms:"):
        config_from_args(_build_parser().parse_args(["serve", "--itl-target-ms", bad]))


def test_the_serve_command_maps_cpu_threads():
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args

    assert config_from_args(_build_parser().parse_args(["serve", "--cpu-threads", "3"])).cpu_threads_per_worker == 3
    assert config_from_args(_build_parser().parse_args(["serve"])).cpu_threads_per_worker is None
    with pytest.raises(ValueError, match="^cpu_threads_per_worker:"):
        ServeConfig(cpu_threads_per_worker=0)


def test_the_serve_command_maps_placement_flags():
    from pdserve.cli import PLACEMENT_POLICIES, _build_parser
    from pdserve.cluster.main import config_from_args
    from pdserve.router.placement.placement_config import POLICIES

    assert PLACEMENT_POLICIES == POLICIES
    args = _build_parser().parse_args(["serve", "--placement-policy", "ring", "--load-factor", "1.5"])
    cfg = config_from_args(args)
    assert (cfg.placement.policy, cfg.placement.load_factor) == ("ring", 1.5)
    default = config_from_args(_build_parser().parse_args(["serve"])).placement
    assert (default.policy, default.load_factor) == ("index", 1.25)
    with pytest.raises(ValueError, match="^load_factor:"):
        config_from_args(_build_parser().parse_args(["serve", "--load-factor", "0.5"]))


def test_the_serve_command_maps_the_triton_decode_flag():
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args

    assert config_from_args(_build_parser().parse_args(["serve", "--triton-decode"])).engine.triton_decode_kernels is True
    assert config_from_args(_build_parser().parse_args(["serve"])).engine.triton_decode_kernels is None
    assert config_from_args(_build_parser().parse_args(["serve", "--no-triton-decode"])).engine.triton_decode_kernels is False
