"""bench/kv_transfer.py's hand-over between tensor-parallel widths on CPU: a TP2 producer's two
per-rank pools (each a region of its own) READ by a TP1 consumer, and TP1 into TP2, every READ
checked against the producer's blocks (each case's last one word for word); and the data pattern
of a rank's pool, which catches a KV head put in the wrong slot."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from bench import kv_transfer as kvb
from bench.kv_widths import parse_staging_streams, parse_widths, rank_heads, shared_stream_of, widths_name, widths_of


class _Bar:
    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


@pytest.mark.parametrize(("widths", "shared_stream"), [((2, 1), False), ((1, 2), False), ((2, 1), True)])
def test_a_read_between_widths_lands_every_head_and_is_timed(
    widths: tuple[int, int], shared_stream: bool, tmp_path
) -> None:
    args = argparse.Namespace(
        device="cpu", gpus="0,1", pool_blocks=12, seed=0, reps=2, warmup=1, no_sockets=True, no_raw=True,
        sizes=[6], main_blocks=6,
    )  # fmt: skip
    name = widths_name(*widths, shared_stream)
    rows, info = kvb.run_variant(args, name, _Bar(), str(tmp_path))
    assert [r["pattern"] for r in rows] == ["contiguous", "fragmented"]
    for r in rows:
        assert r["variant"] == name and r["bytes"] == 6 * kvb.BLOCK_BYTES and r["gbps"] > 0, r
        # Staged: one READ of the blocks of every producer rank, a descriptor per run per rank.
        assert r["reads"] == 1 and r["descriptors"] >= widths[0], r
    assert info["producer_notifications"] == info["reads"] == 2 * (1 + 2)  # every READ's notice


def test_the_pattern_of_a_rank_pool_catches_a_head_in_the_wrong_slot() -> None:
    base = kvb.pattern_base(3, torch.device("cpu"))
    shards = list(zip(rank_heads(2), ["cpu", "cpu"]))
    producer = kvb.worker_pools(shards, 4, torch.device("cpu"), base)
    consumer = kvb.worker_pools(None, 4, torch.device("cpu"), base)
    for _, pool, part_base in producer:
        kvb.fill_pattern(pool, part_base)
    whole = consumer[0][1]
    for heads, pool, _ in producer:  # what a READ between widths does: each rank's heads in place
        whole[:, :, :, :, list(heads)] = pool
    remote, local = [3, 1], [0, 2]
    whole[local] = whole[remote].clone()
    assert kvb.verify(whole, base, local, remote, full=True) and kvb.verify(whole, base, local, remote, full=False)
    # Two heads of one block swapped: the full compare (every case's last READ) catches it; the
    # per-block sums of the other READs catch only missing, torn or misplaced blocks.
    whole[0, :, :, :, [0, 4]] = whole[0, :, :, :, [4, 0]].clone()
    assert not kvb.verify(whole, base, local, remote, full=True)
    whole[0] = 0
    assert not kvb.verify(whole, base, local, remote, full=False)


def test_widths_flag() -> None:
    assert parse_widths("2:1, 1:2") == [(2, 1), (1, 2)] and parse_widths("") == []
    for bad in ("2", "4:1", "a:b"):
        with pytest.raises(ValueError, match="^--widths: "):
            parse_widths(bad)


def test_a_run_label_says_its_widths_and_whether_its_staging_copies_have_streams_of_their_own() -> None:
    assert widths_name(2, 1) == "tp2->tp1" and widths_name(2, 1, True) == "tp2->tp1+shared-stream"
    assert widths_of("tp2->tp1+shared-stream") == (2, 1) and widths_of("shipped") is None
    assert shared_stream_of("tp2->tp1+shared-stream") and not shared_stream_of("tp2->tp1")
    assert parse_staging_streams("own,shared") == [False, True] and parse_staging_streams("shared") == [True]
    with pytest.raises(ValueError, match="^--staging-streams: 'mine'"):
        parse_staging_streams("mine")


def test_a_busy_consumer_is_refused_off_a_gpu_naming_the_flag() -> None:
    argv = [sys.executable, kvb.__file__, "--device", "cpu", "--busy-consumer-ms", "6"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--busy-consumer-ms: a number of ms >= 0, with --device cuda" in done.stderr
