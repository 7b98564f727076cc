"""How fast decode workers' tokens reach the router: the Ray long-poll relay, measured alone.

A synthetic decode actor emits one token per stream per "engine step" at a fixed step rate,
through the same outbox and `poll` method as `DecodeWorker`, while the router side drains it
through `WorkerClient.poll` over a Ray actor, exactly as `Router._relay` does. Reported: tokens/s reaching the
router, and the latency added between a token's creation in the actor and its arrival in the
router (same host, same clock), and the router process's CPU (all of its threads, Ray's
included) per poll and per token. The long-poll runs over each transport the router has: the
token channel (`--token-transport socket`, a TCP connection to the worker) and a Ray actor call
per poll. Beside them, a candidate not in the product: one gRPC server-streaming `Tokens` call
per worker (`--grpc`), typed with worker.proto's messages. The baseline is one Ray call per
token, the naive design.

    python bench/relay.py [--streams 64] [--step-rate 500] [--seconds 5] [--grpc] [--repeat 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import ray  # noqa: E402

from pdserve.cluster.actors import RayWorker  # noqa: E402
from pdserve.cluster.token_channel import ChannelInfo, TokenChannelServer  # noqa: E402
from pdserve.cluster.worker_client import WorkerClient  # noqa: E402
from pdserve_proto import worker_pb2  # noqa: E402

# Not a service of the product: the gRPC candidate this benchmark weighs against the token channel.
_SERVICE = "pdserve.bench.Relay"


class SyntheticDecode:
    """Produces updates like DecodeWorker._on_step; the token value is the step's index."""

    def __init__(self) -> None:
        self._outbox: list[worker_pb2.TokenUpdate] = []
        self._cond = threading.Condition()
        self.step_times: list[float] = []
        self._channel: TokenChannelServer | None = None
        self._grpc: grpc.Server | None = None

    def token_channel(self) -> ChannelInfo:
        if self._channel is None:
            self._channel = TokenChannelServer(self.poll, "127.0.0.1")
        return self._channel.info()

    def tokens_port(self) -> int:
        """Serve `Tokens` (gRPC, server streaming) on a free loopback port."""
        if self._grpc is None:
            from concurrent.futures import ThreadPoolExecutor

            handler = grpc.unary_stream_rpc_method_handler(
                lambda request, context: self.tokens(request),
                request_deserializer=worker_pb2.PollRequest.FromString,
                response_serializer=worker_pb2.TokenUpdates.SerializeToString,
            )
            self._grpc = grpc.server(ThreadPoolExecutor(4))
            self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Tokens": handler}),))
            self._port = self._grpc.add_insecure_port("127.0.0.1:0")
            self._grpc.start()
        return self._port

    def tokens(self, request: worker_pb2.PollRequest) -> Iterator[worker_pb2.TokenUpdates]:
        """Every update as it comes, one message per batch taken from the outbox, until the end."""
        while True:
            updates = self._take(request.wait_s or 0.05)
            if updates.updates:
                yield updates
                if updates.updates[-1].request_id == "__end__":
                    return

    def run(self, streams: int, step_rate: float, seconds: float) -> None:
        def loop() -> None:
            period = 1.0 / step_rate
            next_t = time.perf_counter()
            for step in range(int(step_rate * seconds)):
                now = time.time()
                self.step_times.append(now)
                with self._cond:
                    self._outbox.extend(worker_pb2.TokenUpdate(request_id=f"s{i}", token_ids=[step]) for i in range(streams))
                    self._cond.notify_all()
                next_t += period
                delay = next_t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            with self._cond:
                self._outbox.append(worker_pb2.TokenUpdate(request_id="__end__", finish_reason="length"))
                self._cond.notify_all()

        threading.Thread(target=loop, daemon=True).start()

    def poll(self, request: worker_pb2.PollRequest) -> worker_pb2.TokenUpdates:
        """worker.proto's `Poll`, as a decode worker actor answers it."""
        return self._take(request.wait_s)

    def poll_one(self, wait_s: float) -> worker_pb2.TokenUpdates:
        """One update per call: the naive baseline."""
        return self._take(wait_s, limit=1)

    def _take(self, wait_s: float, limit: int = 0) -> worker_pb2.TokenUpdates:
        with self._cond:
            if not self._outbox:
                self._cond.wait(wait_s)
            if limit:
                out, self._outbox = self._outbox[:limit], self._outbox[limit:]
            else:
                out, self._outbox = self._outbox, []
        return worker_pb2.TokenUpdates(updates=out)

    def times(self) -> list[float]:
        return self.step_times


async def drain(actor, per_token: bool, transport: str) -> tuple[int, list[float], float, int]:
    if transport == "grpc":
        return await drain_stream(actor)
    handle = WorkerClient("synthetic", RayWorker(actor, token_channel=transport == "socket"))
    received, lat_steps, polls = 0, [], 0
    t0 = time.perf_counter()
    while True:
        if per_token:
            updates = await asyncio.wait_for(actor.poll_one.remote(0.05), 5.0)
        else:
            updates = await handle.poll(0.05, 5.0)
        polls += 1
        now = time.time()
        for u in updates.updates:
            if u.request_id == "__end__":
                return received, lat_steps, time.perf_counter() - t0, polls
            received += len(u.token_ids)
            lat_steps.append((u.token_ids[0], now))


async def drain_stream(actor) -> tuple[int, list[float], float, int]:
    """The router's side of one `Tokens` stream: each message counts as a poll."""
    port = await actor.tokens_port.remote()
    received, lat_steps, messages = 0, [], 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        tokens = channel.unary_stream(
            f"/{_SERVICE}/Tokens",
            request_serializer=worker_pb2.PollRequest.SerializeToString,
            response_deserializer=worker_pb2.TokenUpdates.FromString,
        )
        t0 = time.perf_counter()
        async for updates in tokens(worker_pb2.PollRequest(wait_s=0.05)):
            messages += 1
            now = time.time()
            for u in updates.updates:
                if u.request_id == "__end__":
                    return received, lat_steps, time.perf_counter() - t0, messages
                received += len(u.token_ids)
                lat_steps.append((u.token_ids[0], now))
    raise RuntimeError("the Tokens stream ended without its last update")


def measure(streams: int, step_rate: float, seconds: float, per_token: bool, transport: str = "ray") -> dict:
    actor = ray.remote(max_concurrency=8, num_cpus=0)(SyntheticDecode).remote()
    ray.get(actor.times.remote())
    ray.get(actor.run.remote(streams, step_rate, seconds))
    cpu0 = time.process_time()  # this process is the router's side: every thread of it, Ray's included
    received, lat, elapsed, polls = asyncio.run(drain(actor, per_token, transport))
    cpu = time.process_time() - cpu0
    step_times = ray.get(actor.times.remote())
    ray.kill(actor)
    latencies = sorted((now - step_times[step]) * 1000 for step, now in lat)
    return {
        "mode": "one Ray call per token" if per_token else (
            "gRPC Tokens stream" if transport == "grpc" else f"long-poll over {transport}"
        ),
        "streams": streams,
        "offered_tok_s": streams * step_rate,
        "relayed_tok_s": received / elapsed,
        "latency_p50_ms": statistics.median(latencies) if latencies else float("nan"),
        "latency_p99_ms": latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan"),
        "polls": polls,
        "router_cpu_us_per_poll": cpu / polls * 1e6,
        "router_cpu_us_per_token": cpu / max(received, 1) * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--step-rate", type=float, default=500.0, help="engine steps per second (one token per stream each)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--grpc", action="store_true", help="also a gRPC server-streaming Tokens call per worker")
    ap.add_argument("--repeat", type=int, default=1, help="run the long-poll rows this many times each, interleaved")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ray.init(include_dashboard=False, logging_level="WARNING", _node_ip_address="127.0.0.1")
    transports = ["socket", "ray"] + (["grpc"] if args.grpc else [])
    rows = [
        measure(args.streams, args.step_rate, args.seconds, per_token=False, transport=t)
        for _ in range(args.repeat) for t in transports
    ]
    rows.append(measure(args.streams, min(args.step_rate, 100.0), min(args.seconds, 3.0), per_token=True))
    ray.shutdown()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'mode':<25} {'streams':>7} {'offered tok/s':>14} {'relayed tok/s':>14} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'polls':>7} {'CPU us/poll':>12} {'CPU us/tok':>11}")
    for r in rows:
        print(
            f"{r['mode']:<25} {r['streams']:>7} {r['offered_tok_s']:>14.0f} {r['relayed_tok_s']:>14.0f} "
            f"{r['latency_p50_ms']:>8.2f} {r['latency_p99_ms']:>8.2f} {r['polls']:>7} "
            f"{r['router_cpu_us_per_poll']:>12.0f} {r['router_cpu_us_per_token']:>11.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
