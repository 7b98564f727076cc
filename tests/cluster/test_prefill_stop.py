"""A prefill worker whose prompt's first token already ends the answer (a stop string matches
it) keeps running: the request is pinned for its hand-over like any other, with finish reason
"stop", and the router frees it. It used to free the KV at once, and the worker's step callback
then found no pinned KV for the finished request and stopped the engine loop (every prefill
waiting on that worker hung until its deadline). Real engine and NIXL agent in this process."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.workers import build_prefill
from pdserve.engine.args import EngineArgs
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.cluster


def test_a_stop_string_matched_by_the_first_token_keeps_the_prefill_worker_serving(model_dir: Any):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=64))
    worker = build_prefill("prefill-stop", cfg)
    try:
        ids = worker.engine.tokenize("The capital of France is")
        probe = worker.prefill(ids, SamplingParams(max_tokens=4, temperature=0.0), "probe", timeout_s=60)
        worker.release("probe")
        first = worker.engine.tokenizer.decode([probe.first_token]).strip()
        assert first, "the first token has no text to stop on"

        stopped = worker.prefill(ids, SamplingParams(max_tokens=4, temperature=0.0, stop=[first]), "stopped", timeout_s=20)
        assert stopped.finish_reason == "stop" and stopped.first_token == probe.first_token
        assert len(stopped.handle.block_ids) == len(probe.handle.block_ids)  # pinned for the hand-over
        assert worker.loop.alive
        assert worker.release("stopped") is True
        again = worker.prefill(ids, SamplingParams(max_tokens=4, temperature=0.0), "again", timeout_s=60)
        assert again.first_token == probe.first_token
        worker.release("again")
        assert worker.stats().kv_blocks_in_use == 0 and worker.engine.holds_requests() == 0
    finally:
        worker.close()
        worker.agent.close()
