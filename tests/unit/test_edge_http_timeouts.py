"""The HTTP server's connection clocks, over raw sockets on loopback: an idle connection, one
that trickles its headers and one that stalls its body are each closed within their timeout
(plus slack), while requests sent in time, slowly or not, get their answer. The router behind
the server is a stand-in that answers at once (the clocks are the server's alone)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.router.edge.http_options import HttpOptions
from pdserve.router.edge.http_server import start_http_server
from pdserve_proto import inference_pb2 as pb

OPTIONS = HttpOptions(keep_alive_s=0.6, header_s=1.5, body_s=1.5)
SLACK_S = 0.6  # a loaded 2-core machine: the clock's callback may run this late


@dataclass(frozen=True)
class _Config:
    model_id: str = "m"
    max_model_len: int = 64


class _AnswerRouter:
    """What the HTTP server calls of a Router: one chunk back at once."""

    config = _Config()
    decode_policy = SimpleNamespace(workers=["decode-0"])
    tokenizer = None  # a model served by token ids

    async def generate(self, request: pb.GenerateRequest, *_: Any, **__: Any) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(text="ok", finish_reason="stop", usage=pb.Usage(prompt_tokens=1))


BODY = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
HEAD = (
    "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(BODY)}\r\n\r\n"
).encode()


def _run(test: Callable[[int], Awaitable[None]], options: HttpOptions = OPTIONS) -> None:
    async def main() -> None:
        runner, port = await start_http_server(_AnswerRouter(), "127.0.0.1", 0, options=options)  # type: ignore[arg-type]
        try:
            await test(port)
        finally:
            await runner.cleanup()

    asyncio.run(main())


async def _closed_after(reader: asyncio.StreamReader, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closes the connection (EOF), and what it sent before."""
    start = time.monotonic()
    got = await asyncio.wait_for(reader.read(), limit_s)
    return time.monotonic() - start, got


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        took, got = await _closed_after(reader, 10)
        assert got == b"" and OPTIONS.keep_alive_s - 0.1 <= took <= OPTIONS.keep_alive_s + SLACK_S, took
        writer.close()

    _run(test)


def test_a_connection_is_idle_again_after_its_answer():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + BODY)
        answer = await _answer(reader)
        assert answer.startswith(b"HTTP/1.1 200") and b'"text": "ok"' in answer
        writer.write(HEAD + BODY)  # keep-alive: a second request on the same connection
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        took, got = await _closed_after(reader, 10)
        assert got == b"" and took <= OPTIONS.keep_alive_s + SLACK_S, took
        writer.close()

    _run(test)


def test_headers_trickled_past_the_header_timeout_are_cut_off():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = time.monotonic()

        async def trickle() -> None:  # a byte every 0.2 s, never the end of the headers
            for b in HEAD[:-4]:
                writer.write(bytes([b]))
                await asyncio.sleep(0.2)

        sender = asyncio.create_task(trickle())
        got = await asyncio.wait_for(reader.read(), 10)
        took = time.monotonic() - start
        sender.cancel()
        # Past the keep-alive timeout (the header clock, not the idle one, applies), within the header one.
        assert got == b"" and OPTIONS.header_s - 0.1 <= took <= OPTIONS.header_s + SLACK_S, took
        writer.close()

    _run(test)


def test_headers_sent_slowly_within_the_header_timeout_get_their_answer():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(0, len(HEAD), len(HEAD) // 5 + 1):  # over about 1 s: longer than keep-alive
            writer.write(HEAD[i:i + len(HEAD) // 5 + 1])
            await asyncio.sleep(0.2)
        writer.write(BODY)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        writer.close()

    _run(test)


def test_a_stalled_body_gets_408_and_the_connection_closes():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + BODY[:5])  # half a body, then nothing
        took, got = await _closed_after(reader, 10)
        assert got.startswith(b"HTTP/1.1 408") and b'"param": "body"' in got, got[:200]
        assert OPTIONS.body_s - 0.1 <= took <= OPTIONS.body_s + SLACK_S, took
        writer.close()

    _run(test)


def test_many_open_connections_are_all_closed_and_the_server_still_answers():
    async def test(port: int) -> None:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
        for i, (_, writer) in enumerate(conns):
            writer.write([b"", HEAD[:20], HEAD + BODY[:3]][i % 3])  # idle, half headers, half a body
        ends = await asyncio.gather(*(_closed_after(reader, 10) for reader, _ in conns))
        assert max(took for took, _ in ends) <= max(OPTIONS.header_s, OPTIONS.body_s) + SLACK_S
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + BODY)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        for _, w in conns + [(reader, writer)]:
            w.close()

    _run(test)


def test_defaults_and_bad_values():
    d = HttpOptions()
    assert (d.keep_alive_s, d.header_s, d.body_s, d.allow_unknown_fields) == (5.0, 30.0, 60.0, False)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="header_s"):
            HttpOptions(header_s=bad)


def test_the_flags_reach_serve_and_router_configs():
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args, router_config_from_args

    flags = ["--timeout-keep-alive", "2", "--http-header-timeout", "3", "--http-body-timeout", "4",
             "--allow-unknown-fields", "--allow-special-tokens-in-prompt"]
    for command, build in (("serve", config_from_args), ("router", router_config_from_args)):
        extra = ["--address", "127.0.0.1:6379"] if command == "router" else []
        cfg = build(_build_parser().parse_args([command, *extra, *flags]))
        assert cfg.http_options == HttpOptions(keep_alive_s=2, header_s=3, body_s=4, allow_unknown_fields=True)
        assert cfg.allow_special_tokens_in_prompt
        default = build(_build_parser().parse_args([command, *extra]))
        assert default.http_options == HttpOptions() and not default.allow_special_tokens_in_prompt
