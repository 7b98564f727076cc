"""`pdserve bench serve` against a server that fails a share of its requests (fault injection):
the failures are counted, reported, and fail the command; a missing optional dependency stops it
before the first request; the report survives a plot that cannot be written."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

pytestmark = pytest.mark.cluster


class FlakyServer:
    """An OpenAI-style /v1/completions stream that answers 503 to `fail_every` of every 10 requests."""

    def __init__(self, fail_every: int) -> None:
        self.fail_every = fail_every
        self.completions = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, runner.addresses[0][1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "flaky", "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        n = self.completions
        self.completions += 1
        if n % 10 < self.fail_every:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await resp.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def flaky() -> Iterator[FlakyServer]:
    server = FlakyServer(fail_every=7)
    yield server
    server.close()


def bench_argv(url: str, *extra: str) -> list[str]:
    return ["bench", "serve", "--url", url, "--workload", "chat", "--scale", "0.05", "--requests", "20",
            "--rate", "200", "--max-output", "4", "--warmup", "0", "--quiet", *extra]


def test_a_run_where_most_requests_failed_exits_1_and_says_why(flaky, capsys, tmp_path):
    from pdserve.cli import main

    out = tmp_path / "report.json"
    assert main(bench_argv(flaky.url, "--out", str(out))) == 1
    captured = capsys.readouterr()
    run = json.loads(out.read_text())["runs"][0]
    assert (run["requests"], run["completed"], run["failed"]) == (20, 6, 14)
    assert run["goodput_req_s"] <= run["req_s"] and run["error_share"] == pytest.approx(0.7)
    assert "14 of 20 requests failed (70%)" in captured.err and "HTTP 503" in captured.err
    # Up to the limit the same failures are accepted.
    assert main(bench_argv(flaky.url, "--max-error-share", "0.8")) == 0


def test_plot_without_matplotlib_stops_before_the_first_request(flaky, capsys, tmp_path, monkeypatch):
    from pdserve.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the bench extra is not installed
    assert main(bench_argv(flaky.url, "--plot", str(tmp_path / "curve.png"))) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and ".[bench]" in err
    assert flaky.completions == 0


def test_a_plot_that_cannot_be_written_keeps_the_report(capsys, tmp_path):
    from pdserve.cli import main  # --plot needs matplotlib: the bench extra, which scripts/setup.sh installs

    server = FlakyServer(fail_every=0)
    try:
        out = tmp_path / "report.json"
        png = tmp_path / "missing-dir" / "curve.png"
        argv = bench_argv(server.url, "--out", str(out), "--plot", str(png))
        argv[argv.index("--rate") : argv.index("--rate") + 2] = ["--sweep", "50,100,200"]
        assert main(argv) == 1
    finally:
        server.close()
    assert [r["rate"] for r in json.loads(out.read_text())["runs"]] == [50.0, 100.0, 200.0]
    assert "--plot" in capsys.readouterr().err and not png.exists()
