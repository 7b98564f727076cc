"""Fuzzing the router's two front doors, HTTP JSON and gRPC protobuf: random requests built from
hostile values (NaN, infinities, integers past every bound, lone surrogates, wrong types, deep
nesting) and valid requests with their bytes mutated. Every answer must be a success or the
client's fault (HTTP 2xx/4xx, gRPC OK / INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED), never
a 5xx, UNKNOWN or INTERNAL, never a hang (each call has a deadline), a refusal names the field at
fault (penalties, logit_bias and min_tokens among the fuzzed ones), and no thread may be left
spinning; afterwards the server still serves a greedy request its exact tokens.

The router is served in process over worker doubles (`edge_server`, a decode double that emits
token 7 for every step) with a small real tokenizer and chat template: a real cluster could run
only a few hundred requests in the time, and only the edge's validation is under test here.

Seeded, so a failure replays. PDSERVE_FUZZ_SCALE multiplies the number of requests (1: CI, about
a minute in all on two cores; 100: the nightly run); PDSERVE_FUZZ_SEED picks another seed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc

from pdserve_proto import inference_pb2 as pb
from tests.unit.edge_server import DOUBLE_TOKEN, OnePollDecode, served, small_tokenizer

SCALE = float(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))
SEED = int(os.environ.get("PDSERVE_FUZZ_SEED", "20261127"))
REQUESTS = max(1, int(4000 * SCALE))  # per boundary
IN_FLIGHT = 8
CALL_TIMEOUT_S = 20.0  # far above any answer here: past it, a call hung

_NASTY_NUMBERS: list[Any] = [
    0, 1, -1, 2, 7, 16, 255, 4095, 4096, 2**31 - 1, 2**31, 2**32, 2**40, 2**63, 2**64, -(2**63), 10**400,
    0.0, -0.0, 0.5, 1e-300, 1.5, 2.0, 100.0, 100.5, 1e30, -1e30, math.nan, math.inf, -math.inf,
]
_NASTY_STRINGS = ["", "a", "hello world", "\ud800", "a\udc00b", "\x00", "\u202e", "<s>", "</s>", "x" * 300,
                  "😀" * 10, "m", "user", "system", "assistant", "tool", "robot", "the quick brown fox"]
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "user", "logprobs",
           "echo", "suffix", "response_format", "unknown_field", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "logit_bias", "min_tokens", "top_logprobs"]
# logit_bias keys as JSON writes them: token ids in and out of range, and what is no token id at all.
_BIAS_KEYS = ["0", "13", "299", "300", "4294967295", "4294967296", "-1", "1e3", "x", "", " 7", "\u0663", "07"]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.random()
    if kind < 0.35 or depth > 3:
        return rng.choice(_NASTY_NUMBERS + _NASTY_STRINGS + [None, True, False])
    if kind < 0.55:
        return [rng.randrange(-2, 400) if rng.random() < 0.9 else rng.choice(_NASTY_NUMBERS)
                for _ in range(rng.randrange(0, 6))]
    if kind < 0.75:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind < 0.9:
        return {"role": rng.choice(_NASTY_STRINGS), "content": _value(rng, depth + 1)}
    return {rng.choice(_FIELDS + ["type", "text", "include_usage"]): _value(rng, depth + 1)}


def _logit_bias(rng: random.Random) -> dict[str, Any]:
    return {rng.choice(_BIAS_KEYS): rng.choice(_NASTY_NUMBERS + [None, "1", True, [1]]) for _ in range(rng.randrange(0, 4))}


def _messages(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return _value(rng)
    return [{"role": rng.choice(["user", "system", "assistant", "user", "robot"]),
             "content": rng.choice(_NASTY_STRINGS) if rng.random() < 0.8 else _value(rng)}
            for _ in range(rng.randrange(1, 4))]


def _body(rng: random.Random, chat: bool) -> dict[str, Any]:
    """A request that is mostly well formed, with a few fields hostile or out of place."""
    body: dict[str, Any] = {"messages": _messages(rng)} if chat else {
        "prompt": rng.choice([[1, 2, 3], "the quick brown fox", [rng.randrange(0, 300) for _ in range(8)]])}
    body["max_tokens"] = rng.choice([1, 4, 16, 300])
    for _ in range(rng.randrange(0, 5)):
        name = rng.choice(_FIELDS)
        body[name] = _logit_bias(rng) if name == "logit_bias" and rng.random() < 0.7 else _value(rng)
    if rng.random() < 0.2:
        body.pop(rng.choice(list(body)), None)
    return body


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        op = rng.random()
        i = rng.randrange(0, len(b) + 1)
        if op < 0.3 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op < 0.5:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        elif op < 0.7 and b:
            del b[i:i + rng.randrange(1, 4)]
        elif op < 0.85:
            b = b[:i]
        else:
            b[i:i] = b[: rng.randrange(0, len(b) + 1)]
    return bytes(b)


def _http_case(rng: random.Random) -> tuple[str, bytes]:
    chat = rng.random() < 0.5
    route = "chat/completions" if chat else "completions"
    roll = rng.random()
    if roll < 0.03:
        depth = rng.choice([50, 1000, 100_000])
        return route, ("[" * depth + "]" * depth).encode()
    data = json.dumps(_body(rng, chat)).encode()  # NaN and Infinity as JSON's non-standard literals
    if roll < 0.35:
        data = _mutate(rng, data)
    return route, data


def _grpc_request(rng: random.Random) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    which = rng.randrange(4)
    if which == 0:
        req.prompt = rng.choice([s for s in _NASTY_STRINGS if not any(0xD800 <= ord(c) < 0xE000 for c in s)])
    elif which == 1:
        req.prompt_token_ids.extend(rng.choice([0, 1, 299, 49_999, 50_000, 2**31, 2**32 - 1])
                                    for _ in range(rng.randrange(0, 6)))
    elif which == 2:
        for _ in range(rng.randrange(0, 4)):
            req.messages.add(role=rng.choice(["user", "system", "robot", ""]), content=rng.choice(["hi", "", "x" * 50]))
    if rng.random() < 0.2:
        req.model = rng.choice(["", "m", "other"])
    if rng.random() < 0.1:
        req.request_id = rng.choice(["", "dup", "r" * 200])
    sp = req.sampling_params
    floats = [0.0, 0.5, 1.0, 2.0, 100.0, 101.0, 1e30, -1.0, math.nan, math.inf, -math.inf, 1e-40]
    for name, choose in (
        ("max_tokens", lambda: rng.choice([0, 1, 4, 300, 4095, 2**32 - 1])),
        ("temperature", lambda: rng.choice(floats)),
        ("top_p", lambda: rng.choice(floats)),
        ("top_k", lambda: rng.choice([-(2**31), -2, -1, 0, 1, 50, 2**31 - 1])),
        ("seed", lambda: rng.choice([0, 1, 2**63, 2**64 - 1])),
        ("ignore_eos", lambda: rng.random() < 0.5),
        ("presence_penalty", lambda: rng.choice(floats)),
        ("frequency_penalty", lambda: rng.choice(floats)),
        ("repetition_penalty", lambda: rng.choice(floats)),
        ("min_tokens", lambda: rng.choice([0, 1, 5, 300, 2**32 - 1])),
        ("n", lambda: rng.choice([0, 1, 2, 16, 17, 2**32 - 1])),
        ("logprobs", lambda: rng.random() < 0.5),
        ("top_logprobs", lambda: rng.choice([0, 2, 20, 21, 2**32 - 1])),
    ):
        if rng.random() < 0.5:
            setattr(sp, name, choose())
    if rng.random() < 0.3:
        for _ in range(rng.randrange(0, 4)):
            sp.logit_bias[rng.choice([0, 7, 299, 300, 2**32 - 1])] = rng.choice(floats)
    if rng.random() < 0.3:
        sp.stop.extend(rng.choice(["", "x", "\u202e", "y" * 300]) for _ in range(rng.randrange(0, 20)))
    if rng.random() < 0.3:
        sp.stop_token_ids.extend(rng.choice([0, 2, 2**32 - 1]) for _ in range(rng.randrange(0, 300)))
    return req


def _grpc_case(rng: random.Random) -> bytes:
    data = _grpc_request(rng).SerializeToString()
    return _mutate(rng, data) if rng.random() < 0.4 else data


async def _run_all(cases: list[Any], call: Callable[[Any], Any]) -> list[Any]:
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(case: Any) -> Any:
        async with gate:
            return await asyncio.wait_for(call(case), CALL_TIMEOUT_S)

    return await asyncio.gather(*(one(c) for c in cases))


def _cpu_while_idle(seconds: float = 0.5) -> float:
    """The process's CPU time per second of wall time while nothing is asked of it: a thread left
    spinning shows as about one core."""
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.monotonic() - t0)


def _fuzz(make_cases: Callable[[random.Random], list[Any]], send: Callable[..., Any]) -> list[Any]:
    rng = random.Random(SEED)
    cases = make_cases(rng)
    threads_before = threading.active_count()

    async def go() -> tuple[list[Any], float]:
        async with served(tokenizer=small_tokenizer(), decode=OnePollDecode()) as s, \
                aiohttp.ClientSession() as http, grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
            answers = await _run_all(cases, lambda case: send(s, http, ch, case))
            await asyncio.sleep(0.2)  # what the requests left behind settles
            cpu = await asyncio.to_thread(_cpu_while_idle)
            assert await s.generate_ids(ch) == [DOUBLE_TOKEN] * 4
            return answers, cpu

    answers, cpu = asyncio.run(go())
    assert cpu < 0.5, f"{cpu:.0%} of a core busy while idle: something spins"
    assert threading.active_count() <= threads_before + 4, threading.enumerate()  # the parse pool at most
    return [(case, answer) for case, answer in zip(cases, answers)]


async def _http_send(s: Any, http: aiohttp.ClientSession, ch: Any, case: tuple[str, bytes]) -> tuple[int, str]:
    route, data = case
    async with http.post(f"{s.http}/v1/{route}", data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.text()


def test_fuzzed_http_json_is_answered_2xx_or_4xx_never_5xx():
    results = _fuzz(lambda rng: [_http_case(rng) for _ in range(REQUESTS)], _http_send)
    bad = [(case[0], case[1][:200], status, text[:300]) for case, (status, text) in results
           if not (200 <= status < 300 or 400 <= status < 500) or '"server_error"' in text]
    assert not bad, bad[:5]
    statuses = {status for _, (status, _) in results}
    assert 200 in statuses and 400 in statuses, statuses  # the fuzz reached both sides
    # A 400 for a JSON object names the field at fault: one the body has (or `prompt`/`messages`,
    # which a body may lack), or a part of one (`messages[0].content`, `logit_bias[13]`).
    unnamed = [(body, text[:300]) for body, status, text in _json_objects(results)
               if status == 400 and _param_root(text) not in {*body, "prompt", "messages"}]
    assert not unnamed, unnamed[:5]


def _json_objects(results: list[Any]) -> list[tuple[dict[str, Any], int, str]]:
    """The cases whose body is a JSON object, with their answers."""
    out = []
    for (_, data), (status, text) in results:
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
            continue
        if isinstance(body, dict):
            out.append((body, status, text))
    return out


def _param_root(text: str) -> str | None:
    """The field an OpenAI error body names (its `param`, up to the first `[` or `.`)."""
    param = json.loads(text)["error"]["param"]
    return None if param is None else param.split("[")[0].split(".")[0]


_ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.RESOURCE_EXHAUSTED}


async def _grpc_send(s: Any, http: Any, ch: grpc.aio.Channel, data: bytes) -> tuple[grpc.StatusCode, str]:
    call = ch.unary_stream("/pdserve.v1.Inference/Generate")(data, timeout=CALL_TIMEOUT_S)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_fuzzed_grpc_messages_are_answered_ok_or_invalid_argument_never_unknown():
    results = _fuzz(lambda rng: [_grpc_case(rng) for _ in range(REQUESTS)], _grpc_send)
    bad = [(data[:100], code, details[:300]) for data, (code, details) in results if code not in _ALLOWED]
    assert not bad, bad[:5]
    codes = {code for _, (code, _) in results}
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= codes, codes
    # Each refusal names what is at fault: a field (`sampling_params.logit_bias[300]: ...`), unknown
    # field numbers, or the request itself when its bytes are no message at all.
    unnamed = [(data[:100], details[:300]) for data, (code, details) in results
               if code == grpc.StatusCode.INVALID_ARGUMENT and not _names_what(details)]
    assert not unnamed, unnamed[:5]


def _names_what(details: str) -> bool:
    """Does a refusal start with what it is about (`field: reason`, or `unknown fields N, ...`)?"""
    head, sep, _ = details.partition(": ")
    return details.startswith("unknown fields ") or bool(sep and head and " " not in head)
