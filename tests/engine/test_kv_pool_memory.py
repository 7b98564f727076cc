"""A CPU engine's KV pool: sized from the host's memory by default, paid for as it is used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine import kv_memory
from pdserve.engine.kv_sizing import cpu_kv_blocks
from pdserve.engine.runner import kv_block_bytes

MiB = 1 << 20


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_default_cpu_pool_follows_host_memory_and_is_logged(tiny_model_factory, monkeypatch, caplog):
    model_dir, _ = tiny_model_factory("llama")
    monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: 64 * MiB)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.kv_memory"):
        llm = LLM(str(model_dir), device="cpu", max_model_len=1024)
    engine = llm.engine
    per_block = kv_block_bytes(engine.model_config, engine.cfg.block_size, engine.cfg.dtype)
    expected = cpu_kv_blocks(per_block, 1024, engine.cfg.block_size, engine.cfg.max_num_seqs, 64 * MiB)
    # 64 sequences of 1024 tokens would want 48 MiB: the pool gets a share of the 64 MiB instead.
    assert engine.blocks.num_blocks == expected < engine.cfg.max_num_seqs * 1024 // engine.cfg.block_size
    assert f"KV pool: {expected} blocks of 16 tokens, {expected * per_block / MiB:.1f} MiB" in caplog.text
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4


def test_workers_on_one_host_split_the_default_pool(tiny_model_factory, monkeypatch):
    model_dir, _ = tiny_model_factory("llama")
    monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: 256 * MiB)
    alone = LLM(str(model_dir), device="cpu", max_model_len=1024).engine.blocks.num_blocks
    shared = LLM(str(model_dir), device="cpu", max_model_len=1024, workers_on_host=4).engine.blocks.num_blocks
    assert shared == alone // 4


def test_cpu_pool_takes_memory_only_for_blocks_written(tiny_model_factory):
    model_dir, _ = tiny_model_factory("llama")
    num_blocks = 32_768  # 12 KiB blocks: a 384 MiB pool
    before = _rss_bytes()
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=num_blocks, max_model_len=1024)
    pool = llm.engine.runner.kv_pool
    pool_bytes = pool.numel() * pool.element_size()
    assert pool_bytes > 300 * MiB
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4
    assert _rss_bytes() - before < pool_bytes / 4
    assert not pool[num_blocks // 2].any()  # unwritten blocks read as zeros


@pytest.mark.parametrize("value", [0, -1])
def test_bad_pool_settings_name_the_field(tiny_model_factory, value):
    model_dir, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="^workers_on_host: must be >= 1"):
        LLM(str(model_dir), device="cpu", workers_on_host=value)
