"""The Ray instance a `pdserve serve` without --address starts for itself, apart from any other on
the host: its own temp directory (sockets, session, logs), its own token, and every listener on
loopback at a port chosen free, where Ray's defaults are fixed (the dashboard agent's 52365, the
autoscaler's and dashboard's metrics on 44217 and 44227). So two `pdserve serve` on one host never
share a raylet, a token or a port, and stopping one leaves the other serving. It never joins a
cluster that Ray's state files or RAY_ADDRESS name (a plain `ray.init()` would, and fails).

`prepare` runs before Ray is imported (the token and the one-machine mode are read at import);
`LocalRay.start` starts the head node and connects this process as its driver; `stop` ends both."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.cluster.ray_address import ONE_MACHINE_VAR, running_cluster, system_temp_dir
from pdserve.cluster.ray_start_retry import kill_monitor, start_local_ray
from pdserve.cluster.stale_ray_dirs import PREFIX, mark_owner, remove_stale

log = logging.getLogger(__name__)

TOKEN_FILE = "auth_token"
# 107 bytes a socket path, less Ray's "/session_<date>_<time>_<micros>_<pid>/sockets/plasma_store".
MAX_TEMP_DIR_BYTES = 107 - 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalRaySettings:
    """One local Ray instance's directory, token and the ports Ray would otherwise fix."""

    temp_dir: Path
    owns_temp_dir: bool  # created here, removed by `LocalRay.stop`
    token_path: Path | None  # None: the user's RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH
    dashboard_agent_port: int
    metrics_export_port: int
    autoscaler_metrics_port: int
    dashboard_metrics_port: int

    def environment(self) -> dict[str, str]:
        """Variables Ray reads at import (this process) or at start-up (the processes it spawns)."""
        env = {
            ONE_MACHINE_VAR: "0",
            "RAY_AUTH_MODE": "token",
            "RAY_USAGE_STATS_ENABLED": "0",
            "AUTOSCALER_METRIC_PORT": str(self.autoscaler_metrics_port),
            "DASHBOARD_METRIC_PORT": str(self.dashboard_metrics_port),
        }
        if self.token_path is not None:
            env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        return env

    def discard(self) -> None:
        """Remove the temp directory if it was created for this instance."""
        if self.owns_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def prepare(temp_dir: str | None, environ: Mapping[str, str]) -> LocalRaySettings:
    """A directory (a new one under the system temp folder unless `temp_dir`, where those that
    killed servers left are removed first), a token file in it (mode 600; unless the environment
    gives Ray a token) and free ports."""
    # Ray's unix sockets live under it, in paths of at most 107 bytes.
    base = Path(temp_dir).resolve() if temp_dir is not None else system_temp_dir(environ) / "pdserve-ray-xxxxxxxx"
    if len(str(base).encode()) > MAX_TEMP_DIR_BYTES:
        flag = "--ray-temp-dir" if temp_dir is not None else "the system temp folder (RAY_TMPDIR or TMPDIR)"
        raise ValueError(
            f"{flag}: {base} is too long for Ray's socket paths (at most {MAX_TEMP_DIR_BYTES} bytes); give "
            "--ray-temp-dir a shorter one"
        )
    if temp_dir is None:
        remove_stale(system_temp_dir(environ))
        root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=system_temp_dir(environ)))
        mark_owner(root, os.getpid())
        owned = True
    else:
        root = base
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        owned = False
    token = None
    if "RAY_AUTH_TOKEN" not in environ and "RAY_AUTH_TOKEN_PATH" not in environ:
        token = root / TOKEN_FILE
        token.touch(mode=0o600, exist_ok=True)
        token.chmod(0o600)
        token.write_text(secrets.token_hex(32))
    return LocalRaySettings(
        temp_dir=root, owns_temp_dir=owned, token_path=token,
        dashboard_agent_port=free_port(), metrics_export_port=free_port(),
        autoscaler_metrics_port=free_port(), dashboard_metrics_port=free_port(),
    )  # fmt: skip


class LocalRay:
    """A running head node of this process's own and the driver connection to it."""

    def __init__(self, settings: LocalRaySettings, node: Any) -> None:
        self.settings = settings
        self._node = node

    @property
    def address(self) -> str:
        """The GCS address (HOST:PORT) that `pdserve router --address` takes."""
        return str(self._node.gcs_address)

    @classmethod
    def start(
        cls, settings: LocalRaySettings, namespace: str, system_config: Mapping[str, Any], log_to_driver: bool,
    ) -> LocalRay:
        """Start the head node on loopback with `settings` and connect to it; on any failure
        (SIGINT and SIGTERM included) what started is stopped again."""
        import ray

        node = None
        try:
            # Once more if the raylet misses Ray's start-up wait: the directory, token and ports
            # `prepare` chose stay (Ray read the token's path at import).
            node = start_local_ray(lambda: _head_node(settings, system_config))
            ray.init(
                address=node.gcs_address, namespace=namespace, log_to_driver=log_to_driver,
                logging_level=logging.WARNING, configure_logging=True,
            )  # fmt: skip
        except BaseException:
            _stop(node, settings)
            raise
        return cls(settings, node)

    def stop(self) -> None:
        """Disconnect, stop every process of the node and remove its directory if created here."""
        _stop(self._node, self.settings)


def _head_node(settings: LocalRaySettings, system_config: Mapping[str, Any]) -> Any:
    """The node as `ray.init()` starts one, but with the ports it offers no argument for (new
    parameters each attempt: a node that starts writes the ports it picked into them)."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        node_ip_address="127.0.0.1",
        include_dashboard=False,
        temp_dir=str(settings.temp_dir),
        dashboard_agent_listen_port=settings.dashboard_agent_port,
        metrics_export_port=settings.metrics_export_port,
        _system_config=dict(system_config),
    )
    return Node(params, head=True, shutdown_at_exit=False, spawn_reaper=True, ray_init_cluster=True)


def _stop(node: Any, settings: LocalRaySettings) -> None:
    import ray

    try:
        ray.shutdown()
    finally:
        if node is not None:
            kill_monitor(node)
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        settings.discard()


class RayStarter:
    """`Cluster.start`'s `start_ray` for `pdserve serve`: join `address`, or start a Ray instance
    of this server's own from `settings` (saying which cluster it does not join), then call
    `connected` (ray.init takes over SIGTERM; the caller installs its handlers again). `stop`
    ends what it started; `address` is the GCS address once connected."""

    def __init__(
        self, address: str | None, settings: LocalRaySettings | None, namespace: str,
        system_config: Mapping[str, Any], log_to_driver: bool, progress: Callable[[str], None],
        connected: Callable[[], None],
    ) -> None:  # fmt: skip
        if address is None and settings is None:
            raise ValueError("a local Ray instance needs its settings (local_ray.prepare)")
        self._join = address
        self._settings = settings
        self._namespace = namespace
        self._system_config = dict(system_config)
        self._log_to_driver = log_to_driver
        self._progress = progress
        self._connected = connected
        self.head: LocalRay | None = None
        self.address: str | None = None

    def __call__(self) -> None:
        import ray

        if self._join is not None:
            ray.init(
                address=self._join, namespace=self._namespace, log_to_driver=self._log_to_driver,
                logging_level=logging.WARNING,
            )  # fmt: skip
            self.address = ray.get_runtime_context().gcs_address
        else:
            assert self._settings is not None
            if (other := running_cluster(os.environ)) is not None:
                self._progress(
                    f"not joining the Ray cluster at {other[0]} (named by {other[1]}): this server starts its own "
                    f"(--address {other[0]} would join that one)"
                )
            self.head = LocalRay.start(self._settings, self._namespace, self._system_config, self._log_to_driver)
            self.address = self.head.address
        self._connected()

    def stop(self) -> None:
        """Stop the local head (and remove its directory) if one was started; leave a joined cluster."""
        if self.head is not None:
            head, self.head = self.head, None
            head.stop()
        elif self._settings is not None:
            self._settings.discard()
