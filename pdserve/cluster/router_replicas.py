"""`pdserve serve --routers N`: N-1 more router processes on this host, each a `pdserve router`
(pdserve.cluster.join) sharing the first router's gRPC and HTTP ports through SO_REUSEPORT, so
the kernel spreads client connections over N event loops, as vLLM runs one API server per
data-parallel rank. The first router alone runs the P:D controller and serves /metrics; where it
does, each replica serves its own series on a loopback port, which the first adds into its
/metrics (pdserve.telemetry.federation)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pdserve.cluster.serve_config import ServeConfig

READY_TIMEOUT_S = 120.0  # a replica joins Ray, finds the workers and loads the tokenizer
STOP_TIMEOUT_S = 15.0


def replica_config(cfg: ServeConfig, ray_address: str, port: int, http_port: int | None) -> ServeConfig:
    """What a replica serves: the first router's listeners (on its bound ports) and edge settings,
    no /metrics (the first router's covers every worker), no controller, no workers of its own."""
    return dataclasses.replace(
        cfg, ray_address=ray_address, port=port, http_port=http_port, metrics_port=None,
        routers=1, reuse_port=True, controller=None,
    )


def ray_client_env(environ: Mapping[str, str], home: Path) -> dict[str, str]:
    """What a second driver of a local Ray cluster needs beside the first's environment: its
    listeners kept on loopback, and Ray's token (`pdserve serve`'s own Ray instance names its
    token in RAY_AUTH_TOKEN_PATH, which the replicas inherit; a plain `ray.init()` cluster keeps it
    in ~/.ray/auth_token)."""
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")}
    token = home / ".ray" / "auth_token"
    if "RAY_AUTH_TOKEN" not in environ and "RAY_AUTH_TOKEN_PATH" not in environ and token.is_file():
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    return env


def _replica_main(cfg: ServeConfig, env: dict[str, str], conn: Connection, share_metrics: bool = False) -> None:
    """A replica's process: serve until SIGTERM or SIGINT, telling the parent when it listens
    (and, with `share_metrics`, the loopback port of its own series)."""
    os.environ.update(env)  # before Ray is imported: Ray reads these at import
    import asyncio
    import signal

    from pdserve.cluster.join import JoinedRouter

    async def serve() -> None:
        joined = await JoinedRouter.start(cfg)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        metrics_port = joined.telemetry.serve_own_metrics() if share_metrics else None
        conn.send(("ready", joined.router_id, metrics_port))
        try:
            await stop.wait()
        finally:
            await joined.stop()

    try:
        asyncio.run(serve())
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


class RouterReplicas:
    """The replica processes of one `pdserve serve`; `stop` ends them (the workers stay)."""

    def __init__(self, processes: list[Any], router_ids: list[str]) -> None:
        self.processes = processes
        self.router_ids = router_ids
        self.metrics_urls: list[str] = []  # each replica's own series, where the first router serves /metrics

    @classmethod
    def start(
        cls, cfg: ServeConfig, count: int, ray_address: str, port: int, http_port: int | None,
        timeout_s: float = READY_TIMEOUT_S,
    ) -> RouterReplicas:
        """Start `count` replicas and wait until each listens; RuntimeError naming the first that
        failed or timed out (the others are stopped)."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no Ray state of the parent's
        env = ray_client_env(os.environ, Path.home())
        rcfg = replica_config(cfg, ray_address, port, http_port)
        started: list[tuple[Any, Connection]] = []
        self = cls([], [])
        try:
            for i in range(count):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_replica_main, args=(rcfg, env, child, cfg.metrics_port is not None),
                                name=f"pdserve-router-{i + 1}")
                p.start()
                child.close()
                started.append((p, parent))
                self.processes.append(p)
            for i, (p, conn) in enumerate(started):
                if not conn.poll(timeout_s):
                    raise RuntimeError(f"router replica {i + 1}: not listening after {timeout_s:g} s")
                try:
                    kind, detail, *rest = conn.recv()
                except EOFError:
                    p.join(1)
                    kind, detail, rest = "error", f"exited ({p.exitcode}) before listening", []
                if kind != "ready":
                    raise RuntimeError(f"router replica {i + 1}: {detail}")
                self.router_ids.append(detail)
                if rest and rest[0] is not None:
                    self.metrics_urls.append(f"http://127.0.0.1:{rest[0]}/metrics")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()  # SIGTERM: the replica stops its listeners and leaves the workers
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.processes = []
