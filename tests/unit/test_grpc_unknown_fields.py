"""No silent drops over gRPC: a request carrying fields its message does not define (a client of a
newer or another .proto) is refused with INVALID_ARGUMENT naming their numbers, at any depth,
unless the server runs with `--allow-unknown-fields`; through a real grpc server and channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from pdserve.router.edge.grpc_server import start_grpc_server
from pdserve.router.edge.unknown_fields import unknown_fields
from pdserve_proto import inference_pb2 as pb


class _EchoRouter:
    """What the servers call of a Router: one chunk back, the prompt's text."""

    config = SimpleNamespace(model_id="echo", max_model_len=64)
    decode_policy = SimpleNamespace(workers=["decode-0"])
    tokenizer = None

    async def generate(self, request: pb.GenerateRequest, *_: Any, **__: Any) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(text=request.prompt, finish_reason="stop")

    def model_info(self) -> pb.ModelInfo:
        return pb.ModelInfo(id="echo", max_model_len=64)

    async def cluster_stats(self) -> pb.ClusterStats:
        return pb.ClusterStats()


def _varint_field(number: int, value: int) -> bytes:
    """A varint field on the wire (numbers and values below 2^14 and 128 here)."""
    key = number << 3
    head = bytes([(key & 0x7F) | 0x80, key >> 7]) if key >= 128 else bytes([key])
    return head + bytes([value])


def _submessage(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def _with_unknowns() -> bytes:
    """prompt "hi", an unknown field 99 at the top, 77 in sampling_params, 9 in messages[0]."""
    sp = pb.SamplingParams(max_tokens=2).SerializeToString() + _varint_field(77, 1)
    msg = pb.ChatMessage(role="user", content="x").SerializeToString() + _varint_field(9, 1)
    return pb.GenerateRequest(prompt="hi").SerializeToString() + _varint_field(99, 5) + _submessage(5, sp) + _submessage(4, msg)


def test_unknown_fields_are_found_at_every_depth():
    parsed = pb.GenerateRequest.FromString(_with_unknowns())
    assert unknown_fields(parsed) == ["99", "messages[0].9", "sampling_params.77"]
    assert unknown_fields(pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(n=2, seed=1))) == []
    # A defined number with another wire type (here prompt, 2, as a varint) is set aside as unknown too.
    assert unknown_fields(pb.GenerateRequest.FromString(_varint_field(2, 1))) == ["2 (the wrong wire type)"]


async def _call(allow: bool, method: str, payload: bytes, stream: bool) -> tuple[grpc.StatusCode, str, list[bytes]]:
    server, port = await start_grpc_server(_EchoRouter(), "127.0.0.1", 0, allow_unknown_fields=allow)  # type: ignore[arg-type]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            # Raw bytes in and out: the client side sends exactly what a newer client would.
            if stream:
                call = channel.unary_stream(method)(payload, timeout=10)
                try:
                    return grpc.StatusCode.OK, "", [m async for m in call]
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details() or "", []
            try:
                return grpc.StatusCode.OK, "", [await channel.unary_unary(method)(payload, timeout=10)]
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or "", []
    finally:
        await server.stop(0)


def test_generate_with_unknown_fields_is_refused_naming_them():
    code, details, _ = asyncio.run(_call(False, "/pdserve.v1.Inference/Generate", _with_unknowns(), stream=True))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "99, messages[0].9, sampling_params.77" in details and "--allow-unknown-fields" in details


def test_allow_unknown_fields_ignores_them():
    code, _, out = asyncio.run(_call(True, "/pdserve.v1.Inference/Generate", _with_unknowns(), stream=True))
    assert code == grpc.StatusCode.OK and pb.GenerateResponse.FromString(out[0]).text == "hi"


def test_known_fields_only_pass():
    ok = pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(max_tokens=2)).SerializeToString()
    code, _, out = asyncio.run(_call(False, "/pdserve.v1.Inference/Generate", ok, stream=True))
    assert code == grpc.StatusCode.OK and pb.GenerateResponse.FromString(out[0]).text == "hi"


@pytest.mark.parametrize("method", ["/pdserve.v1.Inference/ListModels", "/pdserve.v1.Admin/GetStats",
                                    "/pdserve.v1.Admin/GetController", "/pdserve.v1.Admin/SetRole"])
def test_every_method_refuses_unknown_fields(method):
    code, details, _ = asyncio.run(_call(False, method, _varint_field(42, 1), stream=False))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown fields 42" in details
