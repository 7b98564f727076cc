"""What `pdserve serve` listens on and what protects each listener: the lines its start-up
prints, and where the workers' KV transfers may listen. Pure: no sockets, no Ray."""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.cluster.ray_address import is_loopback_host
from pdserve.cluster.serve_config import ServeConfig
from pdserve.router.edge.auth import ENV_VAR

LOOPBACK_DEVICE = "lo"


def kv_net_devices(cfg: ServeConfig, environ: Mapping[str, str]) -> str | None:
    """The UCX network devices of the workers' KV transfers: as configured; else the
    environment's UCX_NET_DEVICES; else loopback for a local cluster (its workers share this
    host) and UCX's own choice (None) for workers placed across a Ray cluster's hosts."""
    if cfg.kv_net_devices is not None:
        return cfg.kv_net_devices
    if environ.get("UCX_NET_DEVICES"):
        return None  # UCX reads it itself, in every worker that inherits it
    return None if cfg.ray_address else LOOPBACK_DEVICE


is_loopback = is_loopback_host  # a listener's --host: a bare name or address


def _protection(cfg: ServeConfig, admin: bool) -> str:
    tls = "plain TCP" if cfg.tls is None else ("mutual TLS" if cfg.tls.mutual else "TLS")
    keys = cfg.api_keys
    if not keys.enabled:
        auth = "no API key"
    elif not keys.data:
        # An admin key alone protects only the Admin service: say that the data plane is open.
        auth = "Inference open, no --api-key (Admin: admin key; health open)" if admin else "open, no --api-key"
    elif admin:
        auth = f"API key (Admin: {'admin key' if keys.admin else 'refused, no --admin-api-key'}; health open)"
    else:
        auth = "API key (/health open)"
    return f"{tls}, {auth}"


def exposure_warning(cfg: ServeConfig) -> str | None:
    """The warning for a data plane that anyone who reaches a non-loopback address may call
    (no data-plane key: an admin key alone does not count); None where there is none."""
    if is_loopback(cfg.host) or cfg.api_keys.data:
        return None
    return (
        f"warning: {cfg.host or 'every address'} is not a loopback address and no --api-key (or {ENV_VAR}) is set: "
        "anyone who reaches it may generate; set --api-key, or --require-api-key to refuse to start like this"
    )


def check_required_key(cfg: ServeConfig, required: bool) -> None:
    """With --require-api-key, a listener beyond loopback without a data-plane key is a
    configuration error (ValueError naming the flag), before anything starts."""
    if required and exposure_warning(cfg) is not None:
        raise ValueError(
            f"--require-api-key: --host {cfg.host or '(every address)'} is not a loopback address and no data-plane "
            f"key is set (--api-key, --api-key-file or {ENV_VAR}; --admin-api-key alone does not count)"
        )


def listener_lines(
    cfg: ServeConfig, grpc_port: int, http_port: int | None, metrics_port: int | None, kv_devices: str | None
) -> list[str]:
    """One line per listener, what it serves and what protects it (docs/security.md)."""
    host = cfg.host
    lines = [f"listening: gRPC {host}:{grpc_port} ({_protection(cfg, admin=True)})"]
    if http_port is not None:
        lines.append(f"listening: HTTP {host}:{http_port} ({_protection(cfg, admin=False)})")
    if metrics_port is not None:
        lines.append(f"listening: metrics {host}:{metrics_port} (plain HTTP, no API key: read-only figures)")
    ray = f"Ray at {cfg.ray_address}" if cfg.ray_address else "Ray on 127.0.0.1"
    lines.append(f"listening: {ray} (Ray's token authentication)")
    if cfg.token_transport == "socket":
        where = "the workers' node addresses" if cfg.ray_address else "127.0.0.1"
        lines.append(f"listening: token channels on {where} (a key per worker, handed over Ray)")
    devices = kv_devices or "UCX's choice of devices"
    lines.append(f"listening: KV transfers on {devices} (not authenticated: keep this network isolated)")
    if (warning := exposure_warning(cfg)) is not None:
        lines.append(warning)
    elif not is_loopback(host) and cfg.tls is None:
        lines.append(f"warning: {host} is not a loopback address and TLS is off: API keys cross the network in clear")
    return lines
