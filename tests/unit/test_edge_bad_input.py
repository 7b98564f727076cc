"""Bad input is the client's fault, said so: HTTP 4xx with the OpenAI error naming the field (and
its `code` set), gRPC INVALID_ARGUMENT (NOT_FOUND for an unknown model), never 500 or UNKNOWN.
Each case was a 500, an UNKNOWN or an accepted value before. Served in process over worker
doubles (`edge_server`), since only the edge is under test."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import grpc
import pytest

from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from tests.unit.edge_server import DOUBLE_TOKEN, served

# (raw JSON body, the param the 400 names). Raw text: JSON's NaN, Infinity and "\ud800" escapes.
HTTP_CASES: list[tuple[str, str, str | None]] = [
    ("completions", "[" * 100_000 + "]" * 100_000, "body"),
    ("completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("completions", '{"prompt": [1, 2], "stop": ["\\udc00"]}', "stop"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages[0].content"),
    ("chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("completions", '{"prompt": [1, 2], "seed": 18446744073709551616}', "seed"),
    ("completions", '{"prompt": [1, 2], "stop_token_ids": [1099511627776]}', "stop_token_ids"),
    ("completions", '{"prompt": [1, 2], "stop_token_ids": [-1]}', "stop_token_ids"),
    ("completions", '{"prompt": [1099511627776]}', "prompt"),
    ("completions", '{"prompt": [1, 2], "temperature": NaN}', "temperature"),
    ("completions", '{"prompt": [1, 2], "temperature": Infinity}', "temperature"),
    ("completions", '{"prompt": [1, 2], "temperature": -Infinity}', "temperature"),
    ("completions", '{"prompt": [1, 2], "temperature": 1e30}', "temperature"),
    ("completions", '{"prompt": [1, 2], "temperature": 1' + "0" * 400 + "}", "temperature"),
    ("completions", '{"prompt": [1, 2], "top_p": NaN}', "top_p"),
    ("completions", '{"prompt": [1, 2], "top_p": Infinity}', "top_p"),
    ("completions", '{"prompt": [1, 2], "model": "other"}', "model"),
    ("completions", '{"prompt": [99999]}', "prompt"),  # outside the vocabulary: the router's check
]


def _post_all(cases: list[tuple[str, str, str | None]]) -> list[tuple[int, dict[str, Any]]]:
    async def go() -> list[tuple[int, dict[str, Any]]]:
        out = []
        async with served() as s, aiohttp.ClientSession() as http:
            for route, body, _ in cases:
                async with http.post(f"{s.http}/v1/{route}", data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    out.append((r.status, await r.json()))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
                assert await s.generate_ids(ch) == [DOUBLE_TOKEN] * 4  # still serving
        return out

    return asyncio.run(go())


def test_bad_http_input_is_a_4xx_naming_the_field_with_a_code():
    answers = _post_all(HTTP_CASES)
    for (route, body, param), (status, got) in zip(HTTP_CASES, answers):
        err = got["error"]
        assert 400 <= status < 500, (body[:80], status, err)
        assert err["param"] == param, (body[:80], err)
        assert isinstance(err["code"], str) and err["code"], (body[:80], err)
    assert answers[-2][0] == 404 and answers[-2][1]["error"]["code"] == "model_not_found"


def _sp(**kw: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=pb.SamplingParams(max_tokens=2, **kw))


GRPC_CASES: list[tuple[pb.GenerateRequest, grpc.StatusCode, str]] = [
    (_sp(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.temperature"),
    (_sp(temperature=math.inf), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.temperature"),
    (_sp(temperature=1e30), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.temperature"),
    (_sp(top_p=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p"),
    (_sp(top_p=-math.inf), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p"),
    (_sp(top_k=-5), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_k"),
    (pb.GenerateRequest(prompt_token_ids=[2**31]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (pb.GenerateRequest(prompt_token_ids=[1], model="other"), grpc.StatusCode.NOT_FOUND, "model"),
]


def test_bad_grpc_input_is_invalid_argument_naming_the_field():
    async def go() -> None:
        async with served() as s, grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
            stub = pbg.InferenceStub(ch)
            for req, code, field in GRPC_CASES:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(req, timeout=10):
                        pass
                assert err.value.code() == code, (req, err.value.details())
                assert err.value.details().startswith(f"{field}: "), err.value.details()
            # Bytes that are no GenerateRequest (a string field of bad UTF-8, a truncated field):
            # INVALID_ARGUMENT, where gRPC's own answer is UNKNOWN.
            raw = ch.unary_stream("/pdserve.v1.Inference/Generate")
            for data in (b"\x12\x02\xff\xfe", b"\x12\x09ab", b"\xff\xff\xff"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in raw(data, timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, data
                assert err.value.details().startswith("request: not a valid message"), err.value.details()
            admin = ch.unary_unary("/pdserve.v1.Admin/GetStats")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await admin(b"\xff\xff\xff", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await s.generate_ids(ch) == [DOUBLE_TOKEN] * 4  # still serving

    asyncio.run(go())
