"""Faults, with real workers in this process (real engines, real NIXL, real gRPC): transfer
failures, lease expiry, a full cluster, incompatible KV layouts and handles. Faults come in
through seams the code owns: the decode worker's transport (a test double around the real one),
the router's client of a worker, and the prefill worker's clock."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from pdserve import SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.workers import build_decode, build_prefill
from pdserve.engine.args import EngineArgs
from pdserve.kv_transfer.compat import PROTOCOL_VERSION, KvCompatError, KvLayout
from pdserve.prefill_worker.prefiller import PrefillConfig, PrefillWorker
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

PROMPT = list(range(300, 340))


def greedy(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(offline: Any) -> list[int]:
    return offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids


def generate(channel: grpc.Channel, ids: list[int], max_tokens: int) -> list[int]:
    request = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(max_tokens))
    return [t for chunk in pbg.InferenceStub(channel).Generate(request, timeout=120) for t in chunk.token_ids]


@pytest.mark.parametrize(
    "faults, transfers, failures",
    [
        ({"fail_reads": 1}, 1, 1),  # the retry reads the KV
        ({"drop_reads": 1}, 1, 1),  # a READ that never ends: its deadline passes, the retry reads the KV
        ({"fail_reads": 2}, 0, 2),  # every attempt fails: the decode worker recomputes the prompt
    ],
    ids=["retried", "dropped-then-retried", "recomputed"],
)
def test_failed_transfers_are_retried_then_recomputed_with_the_same_tokens(
    start_in_process, faulty_transport, wait_until, expected, model_dir, faults, transfers, failures
):
    cfg = ServeConfig(
        model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=128),
        transfer_timeout_s=2.0,
    )
    c = start_in_process(cfg, wrap_transport=lambda t: faulty_transport(t, **faults))
    try:
        assert generate(c.channel, PROMPT, 12) == expected
        assert (c.decode.stats().transfers, c.decode.stats().transfer_failures) == (transfers, failures)
        assert c.decode.agent.reads == failures + transfers
        wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed after the faulty transfers")
    finally:
        c.close()


class AlteredHandles:
    """Fault injection: the router's client of a prefill worker, changing one field of every KV
    handle it returns (as a worker of another version or layout would write it)."""

    def __init__(self, client: Any, field: str, value: Any) -> None:
        self.client, self.field, self.value = client, field, value
        self.worker_id = client.worker_id

    async def prefill(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.client.prefill(*args, **kwargs)
        setattr(result.handle, self.field, self.value)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


@pytest.mark.parametrize("field, value", [("protocol_version", PROTOCOL_VERSION + 1), ("compat_hash", "0" * 32)])
def test_decode_refuses_a_handle_of_another_protocol_or_layout_before_reading(
    start_in_process, faulty_transport, wait_until, field, value
):
    c = start_in_process(
        wrap_transport=lambda t: faulty_transport(t),
        wrap_client=lambda client, role: AlteredHandles(client, field, value) if role == "prefill" else client,
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            generate(c.channel, PROMPT, 8)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"decode start: {field}: " in err.value.details(), err.value.details()
        assert c.decode.agent.reads == 0  # refused before a byte was read
        wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed on both workers")
        assert c.prefill.stats().pinned_requests == 0
    finally:
        c.close()


class OlderWorker:
    """Fault injection: the router's client of a worker of a version that predates
    prompt_logprobs (a rolling upgrade: the field is additive, so such a worker ignores it and
    its prefill result and first token update come back without the prompt's scores)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.worker_id = client.worker_id

    async def prefill(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.client.prefill(*args, **kwargs)
        result.ClearField("prompt_logprobs")
        return result

    async def poll(self, *args: Any, **kwargs: Any) -> Any:
        updates = await self.client.poll(*args, **kwargs)
        for u in updates.updates:
            u.ClearField("prompt_logprobs")
        return updates

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_a_worker_that_cannot_score_a_prompt_fails_the_request_naming_prompt_logprobs(
    start_in_process, wait_until, expected
):
    """Never an answer without the prompt_logprobs asked for: prefilled on the prefill worker or
    (a short prompt, `max_local_prefill_tokens`) on the decode worker, the request fails naming
    the field and the worker, and every block is freed; requests without them are served."""
    from pdserve.router.placement.placement_config import PlacementConfig

    c = start_in_process(wrap_client=lambda client, role: OlderWorker(client),
                         router_overrides={"placement": PlacementConfig(max_local_prefill_tokens=32)})
    try:
        stub = pbg.InferenceStub(c.channel)
        scored = pb.SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
        for ids, where in ((PROMPT, "prefill worker prefill-0"), (PROMPT[:20], "decode worker decode-0")):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=scored), timeout=60))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert err.value.details().startswith(f"prompt_logprobs: {where} prefilled"), err.value.details()
        assert c.router.placement_stats()["prefills"] == {"local": 1, "remote": 1}
        assert generate(c.channel, PROMPT, 12) == expected
        wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed after the refused requests")
    finally:
        c.close()


def test_full_cluster_answers_resource_exhausted(start_in_process, wait_until):
    c = start_in_process(router_overrides={"max_inflight_per_decode": 1})
    try:
        stub = pbg.InferenceStub(c.channel)
        long_call = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(500)))
        next(iter(long_call))  # the only decode slot is now taken
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[4, 5], sampling_params=greedy(4)), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = dict(err.value.trailing_metadata() or ())["retry-after-ms"]
        assert err.value.details() == f"decode pool: every worker is at capacity; retry after {hint} ms"
        long_call.cancel()
        wait_until(lambda: c.blocks_in_use() == 0, 15, "blocks freed")
    finally:
        c.close()


def test_unpulled_kv_is_freed_when_its_lease_expires(model_dir, wait_until):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=64))
    now = [1000.0]
    base = build_prefill("prefill-lease", cfg)
    base.close()
    worker = PrefillWorker("prefill-lease", base.engine, base.agent, PrefillConfig(lease_s=5.0), clock=lambda: now[0])
    try:
        prefilled = worker.prefill(list(range(10, 60)), SamplingParams(max_tokens=8, temperature=0.0), "r1", timeout_s=60)
        assert prefilled.handle.lease_deadline == 1005.0 and len(prefilled.handle.block_ids) == 4
        assert worker.stats().kv_blocks_in_use == 4
        now[0] = 1006.0
        wait_until(lambda: worker.stats().kv_blocks_in_use == 0, 10, "the lease to expire")
        assert worker.stats().lease_expiries == 1
    finally:
        worker.close()


def test_incompatible_kv_layouts_refuse_to_connect(model_dir):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=16))
    p = build_prefill("prefill-a", cfg)
    other = EngineArgs(num_kv_blocks=16, block_size=32)
    d = build_decode("decode-b", ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=other))
    try:
        with pytest.raises(KvCompatError, match="compat_hash: worker 'prefill-a' has KV layout"):
            d.agent.connect(p.agent.info())
    finally:
        p.close()
        d.close()
    a = KvLayout("m", "float32", 2, 2, 8, 16, hash_version=1)
    assert a.compat_hash() != KvLayout("m", "bfloat16", 2, 2, 8, 16, hash_version=1).compat_hash()
    assert a.compat_hash() == KvLayout("m", "float32", 2, 2, 8, 16, hash_version=1).compat_hash()
