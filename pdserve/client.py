"""`pdserve generate --address`: stream answers from a running server over gRPC."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def open_channel(
    address: str,
    tls: bool = False,
    ca_certs: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    server_name: str | None = None,
) -> grpc.Channel:
    """A channel to a `pdserve serve`: plain, or TLS when asked for or when any certificate is given
    (ca_certs: the CAs to trust, else the system's; certfile/keyfile: a client certificate for mutual TLS)."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("ssl_certfile, ssl_keyfile: give both, or neither")
    if not (tls or ca_certs or certfile):
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(_read(ca_certs), _read(keyfile), _read(certfile))
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=options)


def call_metadata(api_key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def generate_remote(args: argparse.Namespace) -> int:
    channel = open_channel(
        args.address, args.tls, args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile, args.server_name
    )
    metadata = call_metadata(args.api_key or os.environ.get("PDSERVE_API_KEY", "").split(",")[0].strip() or None)
    with channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for prompt in args.prompts:
            tokens: list[int] = []
            text, reason = [], ""
            try:
                for chunk in stub.Generate(build_request(prompt, args), timeout=args.timeout, metadata=metadata):
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
