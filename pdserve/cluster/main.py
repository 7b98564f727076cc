"""`pdserve serve`: run a cluster until SIGINT/SIGTERM; `pdserve router`: one more router in front
of a running cluster's workers, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from pdserve.cluster.listeners import check_required_key, exposure_warning, listener_lines
from pdserve.cluster.router_replicas import RouterReplicas
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ControllerSettings, ServeConfig
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Slo
from pdserve.engine.args import EngineArgs
from pdserve.router.edge.auth import ENV_VAR, ApiKeys, load_keys
from pdserve.router.edge.http_options import HttpOptions
from pdserve.router.edge.limits import InputLimits
from pdserve.router.edge.tls import tls_config
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.telemetry.tracing import TracingConfig


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        num_prefill=args.prefill,
        num_decode=args.decode,
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
        ),
        kv_net_devices=args.kv_net_devices,
        token_transport=args.token_transport,
        routers=args.routers,
        controller=controller_from_args(args),
        **edge_from_args(args),
    )


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
    )


def api_keys_from_args(args: argparse.Namespace, environ: os._Environ[str] | dict[str, str]) -> ApiKeys:
    data = load_keys(args.api_key, environ.get(ENV_VAR), args.api_key_file)
    admin = args.admin_api_key or environ.get("PDSERVE_ADMIN_API_KEY") or None
    return ApiKeys(data=data, admin=(admin,) if admin else ())


def _say(line: str) -> None:
    print(f"pdserve: {line}", flush=True)


async def _serve(cfg: ServeConfig, verbose: bool) -> None:
    cluster = await Cluster.start(cfg, progress=_say, worker_logs=verbose)
    # Handlers first: a client may stop the server as soon as it reads the address, and until
    # then SIGTERM would go to Ray's own handler, which kills the process without a shutdown.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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
    replicas = None
    try:
        if cfg.routers > 1:
            replicas = await _start_replicas(cfg, cluster)
        await stop.wait()
        print("pdserve: shutting down", flush=True)
    finally:
        if replicas is not None:
            await asyncio.to_thread(replicas.stop)
        await cluster.stop()


async def _start_replicas(cfg: ServeConfig, cluster: Cluster) -> RouterReplicas:
    import ray

    gcs = ray.get_runtime_context().gcs_address
    replicas = await asyncio.to_thread(RouterReplicas.start, cfg, cfg.routers - 1, gcs, cluster.port, cluster.http_port)
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
    return cfg


def serve_forever(args: argparse.Namespace) -> int:
    asyncio.run(_serve(_checked(config_from_args(args), args), args.verbose))
    return 0


async def _route(cfg: ServeConfig) -> None:
    from pdserve.cluster.join import JoinedRouter

    joined = await JoinedRouter.start(cfg, progress=_say)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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
