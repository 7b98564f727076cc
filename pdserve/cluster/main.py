"""`pdserve serve`: run a cluster until SIGINT/SIGTERM; `pdserve router`: one more router in front
of a running cluster's workers, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pdserve.cluster.listeners import check_required_key, exposure_warning, listener_lines
from pdserve.cluster.local_ray import LocalRaySettings, RayStarter
from pdserve.cluster.ray_address import answers, resolve_address, wait_until_answers
from pdserve.cluster.ray_init import LOCAL_RAY_SYSTEM_CONFIG
from pdserve.cluster.router_replicas import RouterReplicas
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ControllerSettings, ServeConfig
from pdserve.cluster.startup_lines import overflow_warning
from pdserve.cluster.status import NAMESPACE
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Slo
from pdserve.engine.args import EngineArgs
from pdserve.router.edge.auth import ENV_VAR, ApiKeys, load_keys
from pdserve.router.edge.http_options import HttpOptions
from pdserve.router.edge.limits import InputLimits
from pdserve.router.edge.tls import tls_config
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.telemetry.tracing import TracingConfig


class _Stoppable(Protocol):
    async def stop(self) -> None: ...


_Started = TypeVar("_Started", bound=_Stoppable)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        num_prefill=args.prefill,
        num_decode=args.decode,
        prefill_tensor_parallel_size=_width(args.prefill_tensor_parallel_size, args.tensor_parallel_size),
        decode_tensor_parallel_size=_width(args.decode_tensor_parallel_size, args.tensor_parallel_size),
        ray_address=args.address,
        engine=EngineArgs.from_options(vars(args)),  # the engine flags' dests are its field names
        lease_s=args.lease_s,
        kv_checksum=args.kv_checksum,
        kv_transfer_overlap=args.kv_transfer_overlap,
        router_lease_s=args.router_lease_s,
        cpu_threads_per_worker=args.cpu_threads,
        placement=PlacementConfig(
            policy=args.placement_policy,
            load_factor=args.load_factor,
            max_local_prefill_tokens=args.max_local_prefill_tokens,
            max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        ),
        kv_net_devices=args.kv_net_devices,
        token_transport=args.token_transport,
        routers=args.routers,
        controller=controller_from_args(args),
        keep_workers=args.keep_workers,
        **edge_from_args(args),
    )


def _width(pool: int | None, both: int) -> int:
    """A pool's tensor-parallel width: its own flag where given, else --tensor-parallel-size."""
    return both if pool is None else pool


def router_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """`pdserve router`: its listeners' settings; the model and placement come from the workers."""
    return ServeConfig(model=args.model, ray_address=args.address, **edge_from_args(args))


def edge_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The router's listeners, admission, security and telemetry: the flags `serve` and `router` share."""
    return {
        "host": args.host,
        "port": args.port,
        "http_port": args.http_port,
        "reuse_port": args.reuse_port,
        "max_queued_requests": args.max_queued_requests,
        "poll_interval_s": args.poll_interval_ms / 1000,
        "metrics_port": args.metrics_port,
        "export_worker_metrics": args.export_worker_metrics,
        "api_keys": api_keys_from_args(args, os.environ),
        "tls": tls_config(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs),
        "limits": InputLimits(
            max_request_bytes=args.max_request_bytes,
            max_prompt_chars=args.max_prompt_chars,
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars,
        ),
        "http_options": HttpOptions(
            keep_alive_s=args.timeout_keep_alive,
            header_s=args.http_header_timeout,
            body_s=args.http_body_timeout,
            allow_unknown_fields=args.allow_unknown_fields,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
        ),
        "allow_special_tokens_in_prompt": args.allow_special_tokens_in_prompt,
        "tracing": TracingConfig.from_env().overridden(args.trace_exporter, args.trace_endpoint, args.trace_sample_ratio),
    }


def controller_from_args(args: argparse.Namespace) -> ControllerSettings | None:
    """--controller and its flags (None without it). The performance model is read here, so a
    wrong name or file fails before any worker starts."""
    if not args.controller:
        if args.max_workers is not None:
            raise ValueError("--max-workers: only with --controller (the controller adds and removes the workers)")
        return None
    if args.perf_model is not None:
        load_perf_model(args.perf_model)
    return ControllerSettings(
        slo=Slo(args.slo_ttft_ms, args.slo_itl_ms),
        perf_model=args.perf_model,
        min_interval_s=args.controller_interval_s,
        max_workers=args.max_workers,
        colocated=args.controller_colocated,
    )


def api_keys_from_args(args: argparse.Namespace, environ: os._Environ[str] | dict[str, str]) -> ApiKeys:
    data = load_keys(args.api_key, environ.get(ENV_VAR), args.api_key_file)
    admin = args.admin_api_key or environ.get("PDSERVE_ADMIN_API_KEY") or None
    return ApiKeys(data=data, admin=(admin,) if admin else ())


def _say(line: str) -> None:
    print(f"pdserve: {line}", flush=True)


async def _serve(cfg: ServeConfig, verbose: bool, local: LocalRaySettings | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    # Before anything starts, so that Ctrl-C or SIGTERM during start-up stops it cleanly; and again
    # once Ray is up (`connected`): ray.init installs its own SIGTERM handler, an exit without a shutdown.
    on_signals()
    if cfg.ray_address is not None and not await _answers_unless_stopped(cfg, stop):
        print("pdserve: stopped during start-up", flush=True)
        return
    starter = RayStarter(cfg.ray_address, local, NAMESPACE, LOCAL_RAY_SYSTEM_CONFIG, verbose, _say, on_signals)
    try:
        cluster = await _unless_stopped(Cluster.start(cfg, progress=_say, worker_logs=verbose, start_ray=starter), stop)
    except BaseException:
        starter.stop()
        raise
    if cluster is None:
        starter.stop()
        print("pdserve: stopped during start-up", flush=True)
        return
    shape = (
        f"{cfg.num_prefill} prefill, {cfg.num_decode} decode" if cfg.num_prefill
        else f"colocated: {cfg.num_decode} decode, prefilling locally"
    )
    print(f"pdserve: serving {cluster.router.config.model_id} on {cluster.address} ({shape})", flush=True)
    if cluster.http_address is not None:
        scheme = "http" if cfg.tls is None else "https"
        print(f"pdserve: OpenAI-compatible HTTP API on {scheme}://{cluster.http_address}/v1", flush=True)
    if cluster.metrics_address is not None:
        print(f"pdserve: Prometheus metrics on http://{cluster.metrics_address}/metrics", flush=True)
    for line in listener_lines(cluster.cfg, cluster.port, cluster.http_port, cluster.telemetry.metrics_port,
                               cluster.cfg.kv_net_devices):
        _listing(line)
    token = local.token_path if local is not None and local.token_path else os.environ.get("RAY_AUTH_TOKEN_PATH")
    for line in ray_lines(cfg, starter.address or "", local, token, cluster.port, cluster.http_port):
        _say(line)
    replicas = None
    try:
        if cfg.routers > 1:
            replicas = await _start_replicas(cfg, cluster)
        await stop.wait()
        print("pdserve: shutting down", flush=True)
    finally:
        if replicas is not None:
            await asyncio.to_thread(replicas.stop)
        try:
            await cluster.stop()
            if cfg.keep_workers:
                kept = ", ".join(sorted(cluster.held()))
                _say(f"left the workers serving (--keep-workers): {kept}; `pdserve serve --address "
                     f"{starter.address}` adopts them")  # fmt: skip
        finally:
            starter.stop()


async def _answers_unless_stopped(cfg: ServeConfig, stop: asyncio.Event) -> bool:
    """Wait until the Ray cluster at --address answers (ValueError naming --address past the
    start-up deadline); False once `stop` is set first. Ray's own connect would hold every signal
    for tens of seconds at a time."""
    address = resolve_address(cfg.ray_address or "auto", os.environ)
    if not answers(address):
        _say(f"waiting for the Ray cluster at {address} to answer (up to {cfg.startup_timeout_s:g} s)")
    waiting = asyncio.ensure_future(wait_until_answers(address, cfg.startup_timeout_s))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not waiting.done():
        waiting.cancel()
        return False
    try:
        waiting.result()
    except TimeoutError as exc:
        raise ValueError(f"--address: {exc} (is the Ray cluster up?)") from None
    return True


async def _unless_stopped(start: Awaitable[_Started], stop: asyncio.Event) -> _Started | None:
    """What `start` returns, or None once `stop` is set first: then the start-up is cancelled (it
    undoes what it started) and anything that finished starting meanwhile is stopped."""
    task = asyncio.ensure_future(start)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        late = await task
    except asyncio.CancelledError:
        return None
    await late.stop()
    return None


def ray_lines(
    cfg: ServeConfig, ray_address: str, local: LocalRaySettings | None, token: Path | str | None,
    port: int, http_port: int | None,
) -> list[str]:
    """Where Ray is, and the exact `pdserve router` command that adds a router to this cluster."""
    own = f" (this server's own; its files in {local.temp_dir})" if local is not None and cfg.ray_address is None else ""
    env = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token} " if token else ""
    host = "" if cfg.host == "127.0.0.1" else f" --host {cfg.host}"
    if cfg.reuse_port or cfg.routers > 1:  # the listeners' ports are shared on purpose
        ports = f" --port {port} --reuse-port" + ("" if http_port is None else f" --http-port {http_port}")
    else:
        ports = " --port 0" + ("" if http_port is None else " --http-port 0")
    extra = " (and this server's key and TLS flags)" if cfg.tls is not None or cfg.api_keys.data else ""
    return [f"Ray cluster at {ray_address}{own}",
            f"add a router: {env}pdserve router --address {ray_address}{host}{ports}{extra}"]


async def _start_replicas(cfg: ServeConfig, cluster: Cluster) -> RouterReplicas:
    import ray

    gcs = ray.get_runtime_context().gcs_address
    replicas = await asyncio.to_thread(RouterReplicas.start, cfg, cfg.routers - 1, gcs, cluster.port, cluster.http_port)
    cluster.telemetry.metric_peers.extend(replicas.metrics_urls)  # /metrics counts every router's requests
    for rid, url in zip(replicas.router_ids, replicas.metrics_urls):
        _listing(f"listening: metrics of router {rid} {url.removeprefix('http://').removesuffix('/metrics')} "
                 "(plain HTTP, no API key: its own series, which /metrics adds in)")  # fmt: skip
    print(f"pdserve: {cfg.routers} routers share the ports (routers {', '.join(replicas.router_ids)} beside this one)",
          flush=True)
    return replicas


def _listing(line: str) -> None:
    """A listener line on stdout; a warning on stderr as well, where logs that keep only errors see it."""
    print(f"pdserve: {line}", flush=True)
    if line.startswith("warning: "):
        print(f"pdserve: {line}", file=sys.stderr, flush=True)


def _checked(cfg: ServeConfig, args: argparse.Namespace) -> ServeConfig:
    """`cfg` once its exposure is allowed: --require-api-key refuses an open listener beyond
    loopback (ValueError, before anything starts); without it the warning is said at once."""
    check_required_key(cfg, args.require_api_key)
    if (warning := exposure_warning(cfg)) is not None:
        print(f"pdserve: {warning}", file=sys.stderr, flush=True)
    overflow = overflow_warning(cfg.placement.max_prefill_queue_tokens, cfg.engine.itl_target_ms,
                                cfg.engine.max_prefill_tokens_with_decodes)  # fmt: skip
    if overflow is not None:
        print(f"pdserve: {overflow}", file=sys.stderr, flush=True)
    return cfg


def serve_forever(args: argparse.Namespace, local: LocalRaySettings | None = None) -> int:
    """`pdserve serve`; `local`: the Ray instance to start (`local_ray.prepare`, before Ray was imported)."""
    try:
        asyncio.run(_serve(_checked(config_from_args(args), args), args.verbose, local))
    finally:
        if local is not None:
            local.discard()
    return 0


async def _route(cfg: ServeConfig) -> None:
    from pdserve.cluster.join import JoinedRouter

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    on_signals()  # while it waits for Ray and the workers too; again once ray.init took SIGTERM over
    joined = await _unless_stopped(JoinedRouter.start(cfg, progress=_say, connected=on_signals), stop)
    if joined is None:
        print("pdserve: stopped during start-up", flush=True)
        return
    model = joined.router.config.model_id
    print(f"pdserve: router {joined.router_id} serving {model} on {joined.address}", flush=True)
    if joined.http_port is not None:
        scheme = "http" if cfg.tls is None else "https"
        print(f"pdserve: OpenAI-compatible HTTP API on {scheme}://{cfg.host}:{joined.http_port}/v1", flush=True)
    metrics_port = joined.telemetry.metrics_port
    if metrics_port is not None:
        print(f"pdserve: Prometheus metrics on http://{cfg.host}:{metrics_port}/metrics", flush=True)
    for line in listener_lines(cfg, joined.port, joined.http_port, metrics_port, None):
        if not line.startswith("listening: KV transfers"):  # a router moves no KV
            _listing(line)
    try:
        await stop.wait()
        print("pdserve: shutting down", flush=True)
    finally:
        await joined.stop()


def route_forever(args: argparse.Namespace) -> int:
    from pdserve.cluster.join import JoinError

    try:
        asyncio.run(_route(_checked(router_config_from_args(args), args)))
    except JoinError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return 0
