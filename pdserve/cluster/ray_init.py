"""How `Cluster.start` connects to Ray by default: join a cluster at an address, or start a new
local instance on loopback, once more if Ray gives up waiting for its raylet."""

from __future__ import annotations

import logging
import os

import ray

from pdserve.cluster.actors import NAMESPACE
from pdserve.cluster.ray_start_retry import start_local_ray

log = logging.getLogger(__name__)

# Ray starts its worker processes at nice 15, below the router, the raylet and anything else on
# the host: on a CPU host where the workers' engines are the serving work, every core they
# share with a nice-0 process (the router relaying their tokens, a client) is nearly all that
# process's. A local cluster's workers run at the router's priority.
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0}


def init_ray(address: str | None, worker_logs: bool) -> None:
    """Join the Ray cluster at `address`, or start a new local instance on loopback (`Cluster.start`'s
    default: a library caller's; `pdserve serve` starts its own with `local_ray.RayStarter`)."""
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=worker_logs, logging_level=logging.WARNING)
        return
    # A local cluster stays on loopback only if Ray was imported with this variable set (`pdserve
    # serve` sets it first); otherwise Ray's listeners take the host's address, which is said.
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        log.warning(
            "Ray's listeners of this local cluster bind the host's address: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "
            "before Ray is imported to keep them on loopback (docs/security.md)"
        )
    # Ray turns token authentication on for a new local cluster and logs a warning that it did.
    # The cluster stays authenticated; only the warning is kept off pdserve's start-up. (Setting
    # RAY_AUTH_MODE here instead would come too late: Ray reads it when it is imported.)
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    try:
        start_local_ray(
            lambda: ray.init(
                address="local",  # a new instance, never one that RAY_ADDRESS or Ray's state files name
                namespace=NAMESPACE,
                include_dashboard=False,
                logging_level=logging.WARNING,
                configure_logging=True,
                log_to_driver=worker_logs,
                _node_ip_address="127.0.0.1",
                _system_config=LOCAL_RAY_SYSTEM_CONFIG,
            ),
            after_failure=ray.shutdown,
        )
    finally:
        auth_log.setLevel(level)

