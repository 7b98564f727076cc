"""On two GPUs: a READ between tensor-parallel widths longer than the staging area (several
turns through it), repeated, lands the producer's bytes in every KV head. The copies out of the
staging area are queued on the GPU; a turn that READ into the area before they ran overwrote
what they were about to copy (bench/kv_transfer.py's check caught it on H200s). The copies run
on the area's own streams, as workers make them, and on the device's current stream, each also
while the consumer's GPU is kept busy."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import kv_transfer as kvb
from bench.kv_widths import widths_name
from pdserve.kv_transfer.staging import STAGING_BLOCKS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


class _Bar:
    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


@pytest.mark.parametrize(
    ("widths", "shared_stream", "busy_ms"),
    [
        ((2, 1), False, 0.0), ((1, 2), False, 0.0),
        # The staging area's copies on streams of its own (as workers make them), the consumer's
        # GPU busy as a decode worker's steps keep it: the READ returns with every head in place.
        ((2, 1), False, 6.0), ((1, 2), False, 6.0),
        # On the device's current stream, behind those steps.
        ((2, 1), True, 6.0), ((1, 2), True, 0.0),
    ],
)
def test_reads_between_widths_through_several_staging_turns_land_every_head(
    widths, shared_stream, busy_ms, tmp_path
) -> None:
    blocks = 4 * STAGING_BLOCKS
    args = argparse.Namespace(
        device="cuda", gpus=[0, 1], pool_blocks=2 * blocks, seed=0, reps=3, warmup=1, no_sockets=True, no_raw=True,
        sizes=[blocks], main_blocks=blocks, busy_consumer_ms=busy_ms,
    )  # fmt: skip
    # run_variant raises on the first READ whose blocks differ from the producer's.
    rows, info = kvb.run_variant(args, widths_name(*widths, shared_stream), _Bar(), str(tmp_path))
    assert [r["pattern"] for r in rows] == ["contiguous", "fragmented"]
    for r in rows:
        assert r["reads"] == 4 and r["bytes"] == blocks * kvb.BLOCK_BYTES, r
    assert info["producer_notifications"] == info["reads"] == 2 * (1 + 3)
