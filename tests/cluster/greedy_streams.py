"""Greedy token-id streams over a cluster's gRPC API, one at a time or every prompt at once:
what the controller and role-flip tests compare with the offline engine's tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg


def greedy_stream(channel: grpc.Channel, ids: list[int], max_tokens: int, timeout_s: float = 300) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)
    return [t for c in pbg.InferenceStub(channel).Generate(request, timeout=timeout_s) for t in c.token_ids]


def greedy_streams(channel: grpc.Channel, prompts: list[list[int]], max_tokens: int, timeout_s: float = 300) -> list[list[int]]:
    """Every prompt streamed at once; the tokens in the prompts' order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: greedy_stream(channel, ids, max_tokens, timeout_s), prompts))
