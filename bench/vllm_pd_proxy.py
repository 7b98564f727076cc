"""A minimal proxy in front of a vLLM prefill instance and a vLLM decode instance that share KV
through vLLM's NixlConnector, for `bench/gpu_serve.py`'s vllm-1p1d configuration.

Each /v1/completions request goes first to the prefill instance with max_tokens 1 and
`kv_transfer_params.do_remote_decode` (it computes the prompt's KV and keeps it for a pull), then,
with the `kv_transfer_params` that answer carries, to the decode instance, whose answer (streamed
or not) is passed through. This is the protocol of vLLM's own example proxy.

    python bench/vllm_pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
from aiohttp import web

_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: the prompt, one token, no stream, KV kept for a pull."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return out | {"max_tokens": 1, "stream": False, "kv_transfer_params": dict(_REMOTE_DECODE)}


def decode_body(body: dict[str, Any], prefilled: dict[str, Any]) -> dict[str, Any]:
    return body | {"kv_transfer_params": prefilled.get("kv_transfer_params")}


def make_app(prefill: str, decode: str, timeout_s: float) -> web.Application:
    app = web.Application()

    async def session(_: web.Application) -> Any:
        app["http"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        yield
        await app["http"].close()

    app.cleanup_ctx.append(session)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        http: aiohttp.ClientSession = app["http"]
        async with http.post(f"{prefill}/v1/completions", json=prefill_body(body)) as p:
            if p.status != 200:
                return web.Response(status=p.status, body=await p.read(), content_type="application/json")
            prefilled = await p.json()
        async with http.post(f"{decode}/v1/completions", json=decode_body(body, prefilled)) as d:
            out = web.StreamResponse(status=d.status, headers={"Content-Type": d.headers.get("Content-Type", "")})
            await out.prepare(request)
            async for chunk in d.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def forward_get(request: web.Request) -> web.Response:
        http: aiohttp.ClientSession = app["http"]
        statuses = []
        for base in (prefill, decode) if request.path == "/health" else (decode,):
            async with http.get(base + request.path) as r:
                statuses.append(r.status)
                body = await r.read()
        status = max(statuses)
        return web.Response(status=status, body=body, content_type="application/json" if body else None)

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", forward_get)
    app.router.add_get("/health", forward_get)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="the prefill instance's root URL")
    p.add_argument("--decode", required=True, help="the decode instance's root URL")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each call to an instance, seconds")
    args = p.parse_args(argv)
    web.run_app(make_app(args.prefill, args.decode, args.timeout), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
