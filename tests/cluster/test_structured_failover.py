"""A decode worker killed mid-stream under structured output: the stream resumes on another decode
worker, which rebuilds the grammar's state from the tokens so far, and the answer is still
schema-valid JSON with the same seeded tokens as an undisturbed offline run.

Real workers in this process (real engines, real NIXL); the worker "dies" as in test_failover.py:
its engine loop stops and every later call to it fails the way a dead Ray actor's does."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.grammar_spec import StructuredOutput
from pdserve.router.membership import MembershipConfig
from pdserve_proto import inference_pb2 as pb

pytestmark = pytest.mark.cluster

FAST = MembershipConfig(wait_s=0.05, min_interval_s=0.0, timeout_s=2.0, max_failures=2, retry_s=0.02)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 4, "maxLength": 16},
        "city": {"type": "string", "minLength": 4, "maxLength": 16},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "city", "color"],
    "additionalProperties": False,
}


def test_a_decode_worker_dying_mid_json_is_resumed_with_its_grammar(start_in_process: Any, offline: LLM, wait_until: Any):
    c = start_in_process(
        num_prefill=1, num_decode=2, serve=False, router_overrides={"membership": FAST, "decode_start_timeout_s": 20.0}
    )
    ids = offline.tokenizer.encode(offline.chat_prompt([{"role": "user", "content": "Describe a person in JSON."}]))
    so = StructuredOutput(json_schema=SCHEMA)
    want = offline.generate([ids], SamplingParams(max_tokens=80, temperature=1.0, seed=77, structured_output=so))[0]
    assert len(want.token_ids) > 12 and want.finish_reason == "stop"
    killed: list[str] = []

    def kill_after_six(n: int) -> None:
        if n >= 6 and not killed:
            serving = next(iter(c.router.relay.streams.values())).worker
            killed.append(serving)
            c.kill(serving)

    params = pb.SamplingParams(max_tokens=80, temperature=1.0, seed=77)
    params.structured_output.json_schema = json.dumps(SCHEMA)
    got = c.generate(ids, params, on_chunk=kill_after_six)
    assert killed, "the stream ended before the test could kill its decode worker"
    assert got == want.token_ids  # no token lost or repeated, the grammar and the seeded draws go on
    jsonschema.validate(json.loads(offline.tokenizer.decode(got, skip_special_tokens=True)), SCHEMA)
    survivor = next(d for d in c.decode_workers if d.worker_id != killed[0])
    wait_until(lambda: survivor.stats().kv_blocks_in_use == 0, 10, "the survivor's blocks freed")
