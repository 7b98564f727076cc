"""KV integrity, with real workers in this process (real engines, real NIXL, real gRPC): the
prefill worker checksums every pinned block into the handle, the decode worker checks the
blocks it READ. A READ that lands wrong bytes (the transport double corrupts the destination
after the real READ: a fault injected on purpose) is a failed transfer: the prompt is
recomputed on the decode worker, the client gets exactly the fault-free tokens, and every block
is freed on both workers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.engine.args import EngineArgs
from pdserve.kv_transfer.checksum import block_checksums
from pdserve_proto import inference_pb2 as pb

pytestmark = pytest.mark.cluster

PROMPT = list(range(300, 340))  # 2 full blocks of 16 and a partial one
SHARED = PROMPT[:32] + list(range(500, 520))  # PROMPT's 2 full blocks, then 2 blocks of its own
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(offline: Any) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = offline.generate([PROMPT, SHARED], params)
    return {"prompt": out[0].token_ids, "shared": out[1].token_ids}


def greedy() -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def config(model_dir: Any) -> ServeConfig:
    return ServeConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        engine=EngineArgs(num_kv_blocks=128),
        transfer_timeout_s=5.0,
    )


@pytest.mark.parametrize("corruption", ["flip", "zero"])
def test_a_corrupted_transfer_is_recomputed_with_the_same_tokens_and_every_block_freed(
    start_in_process, faulty_transport, wait_until, expected, model_dir, corruption
):
    c = start_in_process(
        config(model_dir), wrap_transport=lambda t: faulty_transport(t, corrupt_reads=1, corruption=corruption)
    )
    assert c.generate(PROMPT, greedy()) == expected["prompt"]
    d = c.decode
    assert len(d.agent.corrupted) == 1  # the fault did happen
    assert (d.stats().checksum_failures, d.stats().transfers, d.stats().transfer_failures) == (1, 0, 0)
    assert d.agent.reads == 1  # not READ again: the producer freed its copy on the READ's notice
    assert d.stats().checksum_failures == 1
    wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed on both workers")
    assert c.prefill.stats().pinned_requests == 0
    # The corrupted blocks never entered the decode worker's prefix cache: the same prompt again,
    # now over a healthy link, reuses what the recompute cached and still decodes the same tokens.
    assert c.generate(PROMPT, greedy()) == expected["prompt"]
    assert (d.stats().checksum_failures, d.stats().transfers) == (1, 1)
    wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed after the second request")


def test_only_pulled_blocks_are_checked_and_a_clean_transfer_passes(
    start_in_process, faulty_transport, wait_until, expected, model_dir
):
    c = start_in_process(config(model_dir), wrap_transport=lambda t: faulty_transport(t))
    d = c.decode
    assert c.generate(PROMPT, greedy()) == expected["prompt"]
    assert (d.stats().checksum_failures, d.stats().transfers, d.stats().blocks_pulled) == (0, 1, 3)
    # SHARED starts with PROMPT's two full blocks, which the decode worker has cached: it pulls
    # (and checks) only blocks 2 and 3, and the corrupted one is among them.
    d.agent.arm_corruption(1, "flip")
    assert c.generate(SHARED, greedy()) == expected["shared"]
    assert d.stats().checksum_failures == 1 and d.stats().blocks_reused == 0  # counted for committed imports only
    assert d.agent.reads == 2
    wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed on both workers")


def test_the_handle_carries_the_checksums_of_the_pinned_blocks(start_in_process, model_dir):
    c = start_in_process(config(model_dir), serve=False)
    p = c.prefill
    params = SamplingParams(max_tokens=4, temperature=0.0)
    result = p.prefill(PROMPT, params, "r-sums", timeout_s=60)
    h = result.handle
    assert len(h.block_checksums) == len(h.block_ids) == 3
    assert list(h.block_checksums) == block_checksums(p.engine.runner.kv_pool, list(h.block_ids))
    p.release("r-sums")
    p.config = dataclasses.replace(p.config, kv_checksum=False)
    assert len(p.prefill(PROMPT, params, "r-none", timeout_s=60).handle.block_checksums) == 0
    p.release("r-none")


def test_with_the_check_off_a_corrupted_transfer_goes_unnoticed(
    start_in_process, faulty_transport, wait_until, model_dir
):
    """The other side of the first test: without the check the corrupted KV is decoded from."""
    c = start_in_process(config(model_dir), wrap_transport=lambda t: faulty_transport(t, corrupt_reads=1))
    d = c.decode
    d.kv.config = dataclasses.replace(d.kv.config, kv_checksum=False)  # the import's settings
    c.generate(PROMPT, greedy())
    assert len(d.agent.corrupted) == 1
    assert (d.stats().checksum_failures, d.stats().transfers) == (0, 1)
    wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed on both workers")
