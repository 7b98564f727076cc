"""Faults, with real workers in this process (real engines, real NIXL, real gRPC): transfer
failures, lease expiry, a full cluster, incompatible KV layouts. Faults come in through seams
the code owns: the decode worker's transfer agent wrapper and the prefill worker's clock."""

from __future__ import annotations

import grpc
import pytest

from kv_transfer.compat import KvCompatError, KvLayout
from pdserve import LLM, SamplingParams
from pdserve.cluster.config import ServeConfig
from pdserve.cluster.workers import build_decode, build_prefill
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from prefill_worker.worker import PrefillConfig, PrefillWorker
from tests.cluster.conftest import InProcessCluster, all_blocks_free, greedy, wait_for

pytestmark = pytest.mark.cluster


def test_failed_transfers_fall_back_to_recompute_with_the_same_tokens(loop_thread, model_dir):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128, inject_read_failures=2)
    c = InProcessCluster(loop_thread, model_dir, cfg)
    try:
        ids = list(range(300, 340))
        chunks = list(pbg.InferenceStub(c.channel).Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(12, ignore_eos=True)), timeout=120))
        tokens = [t for ch in chunks for t in ch.token_ids]
        offline = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
        assert tokens == offline.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
        assert c.decode.transfer_failures == 2 and c.decode.transfers == 0
        wait_for(all_blocks_free(c.channel), 15, "blocks freed after a failed transfer")
    finally:
        c.close()


def test_full_cluster_answers_resource_exhausted(loop_thread, model_dir):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128)
    c = InProcessCluster(loop_thread, model_dir, cfg, {"max_inflight_per_decode": 1})
    try:
        stub = pbg.InferenceStub(c.channel)
        long_call = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(500, ignore_eos=True)))
        next(iter(long_call))  # the only decode slot is now taken
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[4, 5], sampling_params=greedy(4)), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in err.value.details()
        long_call.cancel()
        wait_for(all_blocks_free(c.channel), 15, "blocks freed")
    finally:
        c.close()


def test_unpulled_kv_is_freed_when_its_lease_expires(model_dir):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    now = [1000.0]
    base = build_prefill("prefill-lease", cfg)
    base.close()
    worker = PrefillWorker("prefill-lease", base.engine, base.agent, PrefillConfig(lease_s=5.0), clock=lambda: now[0])
    try:
        handle = worker.prefill(list(range(10, 60)), SamplingParams(max_tokens=8, temperature=0.0), "r1", timeout_s=60)
        assert handle.lease_deadline == 1005.0 and len(handle.block_ids) == 4
        assert worker.stats().kv_blocks_in_use == 4
        now[0] = 1006.0
        wait_for(lambda: worker.stats().kv_blocks_in_use == 0, 10, "the lease to expire")
        assert worker.stats().lease_expiries == 1
    finally:
        worker.close()


def test_incompatible_kv_layouts_refuse_to_connect(model_dir):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    p = build_prefill("prefill-a", cfg)
    d = build_decode("decode-b", ServeConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16, block_size=32))
    try:
        with pytest.raises(KvCompatError, match="compat_hash: worker 'prefill-a' has KV layout"):
            d.agent.connect(p.agent.info())
    finally:
        p.close()
        d.close()
    a = KvLayout("m", "float32", 2, 2, 8, 16)
    assert a.compat_hash() != KvLayout("m", "bfloat16", 2, 2, 8, 16).compat_hash()
    assert a.compat_hash() == KvLayout("m", "float32", 2, 2, 8, 16).compat_hash()
