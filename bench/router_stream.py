"""The router's CPU per streamed token: the real `Router` and its OpenAI HTTP server in one
process over N synthetic decode workers, loaded over HTTP from another process.

A synthetic worker is an in-process `DecodeHandle` (no engine, no Ray) stepping d0 + d1 * batch
seconds, one update per request per step, whose `poll` behaves as `DecodeWorker.poll`; its own
CPU is taken out of the router's. The load is `pdserve bench serve`'s chat workload, or with
--gpu-workload one of bench/gpu_serve.py's (long-prompt: 3,000-token prompts). Reported:
router CPU per 1000 tokens and SSE events, tokens per event, polls per 1000 tokens, TTFT, ITL.
--compare OLD_TREE runs an older checkout's router first; --poll-cpu-us models a Ray poll's cost.
    python bench/router_stream.py [--workers 1,2,4] [--rate 20] [--requests 200] [--saturate-rate 80]
        [--saturate-requests 400] [--poll-cpu-us 0] [--poll-interval-ms 0] [--gpu-workload NAME]
        [--compare OLD_TREE] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ----- the router's process ---------------------------------------------------------------------


class _Live:
    __slots__ = ("base", "left", "made", "rid")

    def __init__(self, rid: str, max_tokens: int) -> None:
        self.rid = rid
        self.left = max_tokens
        self.base = sum(rid.encode()) * 131  # token ids differ between requests, and are ordinary text
        self.made = 0


def _token(r: _Live) -> int:
    return 1000 + (r.base + 7919 * r.made) % 29000


@dataclass(frozen=True)
class WorkerModel:
    d0_ms: float = 1.5  # a step's fixed time
    d1_ms: float = 0.03  # a step's time per sequence in the batch
    # What a poll costs the router's event loop beyond this in-process call (a Ray actor call's
    # submission and hand-back), burnt on the loop thread and counted as the router's.
    poll_cpu_us: float = 0.0

    def args(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(self).items()]


class SyntheticDecode:
    """A `router.handles.DecodeHandle` whose engine is a step clock (see the module's doc)."""

    def __init__(self, worker_id: str, model: WorkerModel) -> None:
        from pdserve.engine.block_manager import BlockManager

        self.worker_id = worker_id
        self.d0_s, self.d1_s = model.d0_ms / 1000, model.d1_ms / 1000
        self.poll_cpu_s = model.poll_cpu_us / 1e6
        self.live: dict[str, _Live] = {}
        self.step_end: float | None = None  # when the running step ends; None: idle
        self.box: list[Any] = []  # TokenUpdates not yet acked
        self.seq = 0
        self.submitted = asyncio.Event()
        self.blocks = BlockManager(64, 16)
        self.blocks.enable_events()
        self.worker_cpu_s = 0.0  # this worker's own work, on the loop thread's CPU clock
        self.polls = 0
        self.updates = 0

    def _advance(self, now: float) -> None:
        from pdserve_proto import worker_pb2

        while self.step_end is not None and self.step_end <= now:
            for r in list(self.live.values()):
                r.left -= 1
                done = r.left <= 0
                self.seq += 1
                self.box.append(worker_pb2.TokenUpdate(
                    request_id=r.rid, token_ids=[_token(r)], finish_reason="length" if done else "", seq=self.seq))
                r.made += 1
                if done:
                    del self.live[r.rid]
            self.step_end = self.step_end + self._step_s() if self.live else None

    def _step_s(self) -> float:
        return self.d0_s + self.d1_s * len(self.live)

    async def submit(self, request: Any, timeout_s: float) -> Any:
        from pdserve_proto import worker_pb2

        t0 = time.thread_time()
        now = time.monotonic()
        self._advance(now)
        rid = request.request_id
        self.live[rid] = _Live(rid, request.params.max_tokens)
        if self.step_end is None:
            self.step_end = now + self._step_s()
        self.submitted.set()
        self.worker_cpu_s += time.thread_time() - t0
        return worker_pb2.DecodeSubmit(cached_prompt_tokens=0)

    async def start(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("colocated only: the router submits")

    async def abort(self, rid: str, timeout_s: float) -> None:
        self.live.pop(rid, None)

    async def poll(self, wait_s: float, timeout_s: float, acked: int | None = None) -> Any:
        from pdserve_proto import worker_pb2

        if self.poll_cpu_s:
            spent = time.thread_time() + self.poll_cpu_s
            while time.thread_time() < spent:
                pass
        t0 = time.thread_time()
        self.polls += 1
        self._advance(time.monotonic())
        if acked is not None:
            self.box = [u for u in self.box if u.seq > acked]
        if not self.box:
            self.worker_cpu_s += time.thread_time() - t0
            if self.step_end is not None:
                await asyncio.sleep(max(0.0, self.step_end - time.monotonic()))
            else:
                self.submitted.clear()
                try:
                    async with asyncio.timeout(wait_s):
                        await self.submitted.wait()
                except TimeoutError:
                    pass
                if self.step_end is not None:
                    await asyncio.sleep(max(0.0, self.step_end - time.monotonic()))
            t0 = time.thread_time()
            self._advance(time.monotonic())
        wire = worker_pb2.TokenUpdates(updates=self.box).SerializeToString()
        self.updates += len(self.box)
        self.worker_cpu_s += time.thread_time() - t0
        return worker_pb2.TokenUpdates.FromString(wire)  # what the router does with an answer off the wire

    async def health(self, timeout_s: float) -> Any:
        from pdserve_proto import worker_pb2

        return worker_pb2.WorkerHealth(engine_alive=True)

    async def stats(self, timeout_s: float) -> Any:
        from pdserve_proto import inference_pb2

        return inference_pb2.WorkerStats(worker_id=self.worker_id, role="decode")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> Any:
        from pdserve_proto import worker_pb2

        await asyncio.sleep(0 if full else wait_s)
        return worker_pb2.KvEventBatch(**asdict(self.blocks.drain_events(full)))


async def _serve(workers: int, model: WorkerModel, poll_interval_s: float) -> None:
    import pdserve.router as router_pkg
    from pdserve.engine.detokenizer import load_tokenizer
    from pdserve.models.default_model import default_model_dir
    from pdserve.router.edge.http_server import start_http_server
    from pdserve.router.router import Router, RouterConfig

    model_dir = default_model_dir()
    decodes = [SyntheticDecode(f"decode-{i}", model) for i in range(workers)]
    floor = {"poll_interval_s": poll_interval_s} if poll_interval_s else {}  # older trees have no such field
    cfg = RouterConfig(model_id=model_dir.name, max_model_len=8192, vocab_size=49152, **floor)
    router = Router(cfg, load_tokenizer(model_dir), [], decodes)
    await router.start()
    runner, port = await start_http_server(router, "127.0.0.1", 0)

    def snapshot() -> dict:
        return {
            "cpu_s": time.process_time(),
            "sys_cpu_s": os.times().system,
            "worker_cpu_s": sum(d.worker_cpu_s for d in decodes),
            "polls": sum(d.polls for d in decodes),
            "updates": sum(d.updates for d in decodes),
        }

    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def commands() -> None:  # one JSON line per "snap"; end of input stops the router
        for line in sys.stdin:
            if line.strip() == "snap":
                print(json.dumps(asyncio.run_coroutine_threadsafe(_now(snapshot), loop).result()), flush=True)
        loop.call_soon_threadsafe(done.set)

    print(json.dumps({"port": port, "router": str(Path(router_pkg.__file__).parent)}), flush=True)
    threading.Thread(target=commands, daemon=True).start()
    await done.wait()
    await runner.cleanup()
    await router.stop()


async def _now(f: Any) -> Any:
    return f()  # on the loop thread: counters read between two of its steps


# ----- the load generator's process --------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    workers: int
    rate: float
    requests: int
    tree: str  # "" this checkout; else another checkout's router
    gpu_workload: str = ""  # "": `pdserve bench serve`'s chat; else a bench/gpu_serve.py workload


@dataclass(frozen=True)
class StreamResult:
    ttft: float | None
    itl: float | None
    tokens: int
    chunks: int
    error: str | None


class RouterProcess:
    """The router in its own process, answering `snap` with its CPU and counters."""

    def __init__(self, workers: int, model: WorkerModel, poll_interval_ms: float, tree: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", "--workers", str(workers), *model.args(),
             f"--poll-interval-ms={poll_interval_ms}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree or ROOT,
        )
        ready = json.loads(self._line())
        self.url = f"http://127.0.0.1:{ready['port']}"
        self.router_dir = ready["router"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the router process ended (exit {self.proc.wait()})")
        return line

    def snap(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("snap\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


async def _one(session: Any, url: str, prompt: list[int], max_tokens: int) -> StreamResult:
    import aiohttp

    from bench.serve import sse_events

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, chunks, tokens = None, 0, 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return StreamResult(None, None, 0, 0, f"HTTP {resp.status}")
            async for obj in sse_events(resp):
                if "error" in obj:
                    return StreamResult(None, None, 0, chunks, str(obj["error"])[:200])
                if obj.get("choices"):
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    chunks += 1
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        return StreamResult(None, None, 0, chunks, f"{type(exc).__name__}: {exc}"[:200])
    e2e = time.perf_counter() - t0
    itl = (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return StreamResult(ttft, itl, tokens, chunks, None if tokens == max_tokens else f"{tokens} of {max_tokens} tokens")


async def _load(url: str, rate: float, requests: list[Any], seed: int) -> tuple[list[StreamResult], float]:
    import aiohttp

    from bench.serve_workload import poisson_arrivals

    arrivals = poisson_arrivals(len(requests), rate, seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()

        async def send(at: float, req: Any) -> StreamResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await _one(session, url, req.prompt, req.output_len)

        results = await asyncio.gather(*(send(at, r) for at, r in zip(arrivals, requests)))
        return list(results), time.perf_counter() - t0


def _pct(values: Iterable[float], p: float) -> float | None:
    import numpy as np

    v = [x for x in values if x is not None]
    return round(float(np.percentile(v, p)) * 1000, 2) if v else None


def run_requests(run: RunConfig, seed: int) -> list[Any]:
    """The run's requests: `pdserve bench serve`'s chat, or the named bench/gpu_serve.py workload."""
    from bench.serve_workload import synthetic

    if run.gpu_workload:
        from bench.gpu_serve_workloads import WORKLOADS

        return WORKLOADS[run.gpu_workload].requests(run.requests, seed)
    return synthetic("chat", run.requests, seed, 2048, 512)


def measure(run: RunConfig, model: WorkerModel, poll_interval_ms: float, seed: int) -> dict:
    from bench.serve_workload import Request

    requests = run_requests(run, seed)
    server = RouterProcess(run.workers, model, poll_interval_ms, run.tree)
    try:
        asyncio.run(_load(server.url, 50.0, [Request(r.prompt, 16) for r in requests[:10]], seed))  # warm-up
        before, client0 = server.snap(), time.process_time()
        results, wall = asyncio.run(_load(server.url, run.rate, requests, seed))
        after, client1 = server.snap(), time.process_time()
    finally:
        server.close()
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    d = {k: after[k] - before[k] for k in after}
    router_cpu = d["cpu_s"] - d["worker_cpu_s"]
    return {
        "tree": run.tree or "this checkout",
        "router_dir": server.router_dir,
        "workers": run.workers,
        "rate": run.rate,
        "poll_cpu_us": model.poll_cpu_us,
        "poll_interval_ms": poll_interval_ms,
        "workload": run.gpu_workload or "chat (bench serve)",
        "requests": run.requests,
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 1),
        "router_cpu_s": round(router_cpu, 3),
        "router_cpu_share": round(router_cpu / wall, 3),  # of one core
        "worker_cpu_s": round(d["worker_cpu_s"], 3),
        "router_sys_share": round(d["sys_cpu_s"] / max(router_cpu, 1e-9), 3),  # of its CPU: in the kernel
        "client_cpu_share": round((client1 - client0) / wall, 3),  # the load generator's, of one core
        "cpu_ms_per_1k_tok": round(router_cpu * 1e6 / max(tokens, 1), 1),
        "cpu_ms_per_1k_chunks": round(router_cpu * 1e6 / max(chunks, 1), 1),
        "tok_per_chunk": round(tokens / max(chunks, 1), 2),
        "polls_per_1k_tok": round(d["polls"] * 1000 / max(tokens, 1), 1),
        "updates_per_1k_tok": round(d["updates"] * 1000 / max(tokens, 1), 1),
        "ttft_p50_ms": _pct((r.ttft for r in ok), 50),
        "ttft_p99_ms": _pct((r.ttft for r in ok), 99),
        "itl_p50_ms": _pct((r.itl for r in ok), 50),
        "itl_p99_ms": _pct((r.itl for r in ok), 99),
    }


COLUMNS = (
    ("tree", "{}"), ("workload", "{}"), ("workers", "{}"), ("rate", "{:g}"), ("poll_cpu_us", "{:g}"), ("poll_interval_ms", "{:g}"), ("tok_s", "{:.0f}"), ("router_cpu_share", "{:.2f}"),
    ("client_cpu_share", "{:.2f}"),
    ("cpu_ms_per_1k_tok", "{:.1f}"), ("cpu_ms_per_1k_chunks", "{:.1f}"), ("tok_per_chunk", "{:.2f}"),
    ("polls_per_1k_tok", "{:.0f}"), ("ttft_p50_ms", "{}"), ("ttft_p99_ms", "{}"), ("itl_p50_ms", "{}"),
    ("itl_p99_ms", "{}"), ("failed", "{}"),
)


def table(rows: list[dict]) -> str:
    cells = [[name for name, _ in COLUMNS]] + [[fmt.format(r[name]) for name, fmt in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4", help="decode worker counts at --rate (default: 1,2,4)")
    ap.add_argument("--rate", type=float, default=20.0, help="Poisson requests/s of the chat workload (default: 20)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--saturate-rate", type=float, default=80.0, help="a rate that saturates the router; 0: none")
    ap.add_argument("--saturate-requests", type=int, default=400)
    ap.add_argument("--saturate-workers", type=int, default=4)
    ap.add_argument("--d0-ms", type=float, default=1.5, help="a step's fixed time (default: 1.5)")
    ap.add_argument("--d1-ms", type=float, default=0.03, help="a step's time per sequence in the batch (default: 0.03)")
    ap.add_argument("--poll-cpu-us", type=float, default=0.0,
                    help="CPU a poll costs the router's event loop on top (a Ray call's part; default: 0)")
    ap.add_argument("--poll-interval-ms", type=float, default=0.0,
                    help="the router's --poll-interval-ms (RouterConfig.poll_interval_s; default: 0, none)")
    ap.add_argument("--gpu-workload", default="", metavar="NAME",
                    help="one of bench/gpu_serve.py's workloads (chat, long-prompt, prefix-sharing) instead of "
                         "pdserve bench serve's chat")
    ap.add_argument("--compare", default="", metavar="OLD_TREE", help="also run another checkout's router, first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the router's process
    args = ap.parse_args()
    model = WorkerModel(args.d0_ms, args.d1_ms, args.poll_cpu_us)
    if args.serve:
        # This script's folder holds bench/router.py, which would shadow the router package.
        here = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
        asyncio.run(_serve(int(args.workers), model, args.poll_interval_ms / 1000))
        return 0
    sys.path.insert(0, str(ROOT))
    if args.gpu_workload:
        from bench.gpu_serve_workloads import WORKLOADS

        if args.gpu_workload not in WORKLOADS:
            ap.error(f"--gpu-workload: {args.gpu_workload!r}; one of {', '.join(WORKLOADS)}")
    trees = [str(Path(args.compare).resolve()), ""] if args.compare else [""]
    runs = [(int(n), args.rate, args.requests) for n in args.workers.split(",")]
    if args.saturate_rate:
        runs.append((args.saturate_workers, args.saturate_rate, args.saturate_requests))
    rows = []
    for n, rate, m in runs:
        for tree in trees:
            rows.append(measure(RunConfig(n, rate, m, tree, args.gpu_workload), model, args.poll_interval_ms, args.seed))
            print(table(rows[-1:]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
