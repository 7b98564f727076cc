"""`pdserve generate --address`: stream answers from a running server over gRPC."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from pdserve_proto import inference_pb2, inference_pb2_grpc


def build_request(prompt: str, args: argparse.Namespace) -> inference_pb2.GenerateRequest:
    sp = inference_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        sp.seed = args.seed
    if args.chat is False:
        return inference_pb2.GenerateRequest(prompt=prompt, sampling_params=sp)
    return inference_pb2.GenerateRequest(
        messages=[inference_pb2.ChatMessage(role="user", content=prompt)], sampling_params=sp
    )


def generate_remote(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for prompt in args.prompts:
            tokens: list[int] = []
            text, reason = [], ""
            try:
                for chunk in stub.Generate(build_request(prompt, args), timeout=args.timeout):
                    tokens.extend(chunk.token_ids)
                    text.append(chunk.text)
                    reason = chunk.finish_reason or reason
                    if not args.json:
                        print(chunk.text, end="", flush=True)
            except grpc.RpcError as exc:
                print(f"\npdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 2
            if args.json:
                print(json.dumps({"prompt": prompt, "token_ids": tokens, "text": "".join(text), "finish_reason": reason}))
            else:
                print(flush=True)
    return 0
