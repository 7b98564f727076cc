"""The public API's messages: generated code is current, field names are the documented ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve_proto import inference_pb2, kv_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto_sources(tmp_path):
    protos = sorted((ROOT / "proto" / "pdserve_proto").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True, timeout=120,
    )
    for generated in (tmp_path / "pdserve_proto").iterdir():
        committed = ROOT / "pdserve_proto" / generated.name
        assert committed.read_text() == generated.read_text(), f"{generated.name} is stale: run proto/generate.sh"


def test_public_field_names():
    req = inference_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2],
        sampling_params=inference_pb2.SamplingParams(
            max_tokens=4, temperature=0.5, top_p=0.9, top_k=10, seed=3, stop=["x"], stop_token_ids=[7], ignore_eos=True
        ),
    )
    req.messages.add(role="user", content="hi")
    assert inference_pb2.GenerateRequest.FromString(req.SerializeToString()) == req
    resp = inference_pb2.GenerateResponse(request_id="r", token_ids=[5], text="a", finish_reason="stop")
    resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.cached_prompt_tokens = 2, 1, 0
    back = inference_pb2.GenerateResponse.FromString(resp.SerializeToString())
    assert back == resp and (back.usage.prompt_tokens, back.usage.completion_tokens) == (2, 1)
    # The names clients write (and the HTTP API maps to): renaming one breaks them.
    names = {m: set(getattr(inference_pb2, m).DESCRIPTOR.fields_by_name) for m in (
        "GenerateRequest", "SamplingParams", "ChatMessage", "GenerateResponse", "Usage")}
    assert names == {
        "GenerateRequest": {"request_id", "prompt", "prompt_token_ids", "messages", "sampling_params", "model", "tools"},
        "SamplingParams": {
            "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs",
            "top_logprobs", "structured_output", "n", "prompt_logprobs",
        },
        "ChatMessage": {"role", "content", "tool_calls", "tool_call_id"},
        "GenerateResponse": {
            "request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "top_logprobs", "index",
            "prompt_logprobs",
        },
        "Usage": {"prompt_tokens", "completion_tokens", "cached_prompt_tokens"},
    }
    assert inference_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert set(inference_pb2.DESCRIPTOR.services_by_name) == {"Inference", "Admin"}


def test_kv_handle_round_trips_with_large_hashes():
    h = kv_pb2.KvHandle(protocol_version=1, request_id="r", block_ids=[3, 4], block_hashes=[2**63 - 1, 5], lease_deadline=1.5)
    assert kv_pb2.KvHandle.FromString(h.SerializeToString()) == h
