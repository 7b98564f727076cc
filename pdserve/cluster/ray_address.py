"""Where a Ray cluster is, as `pdserve serve` and `pdserve router` need to know it before Ray is
imported: what `--address auto` means (RAY_ADDRESS, or the state file `ray start` leaves in Ray's
temp directory), whether an address is on loopback (Ray then needs its one-machine mode, or it
swaps loopback for the host's external address and never connects), and whether anything answers
there. Nothing here imports Ray."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping
from pathlib import Path

# Ray's own variable: read once, when Ray is imported; "0" keeps a local cluster on loopback.
ONE_MACHINE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
STATE_FILE = "ray_current_cluster"  # written by `ray start` in Ray's temp directory


def system_temp_dir(environ: Mapping[str, str]) -> Path:
    """The folder Ray's temp directories go under, as Ray picks it (RAY_TMPDIR, then TMPDIR)."""
    return Path(environ.get("RAY_TMPDIR") or environ.get("TMPDIR") or "/tmp")


def recorded_address(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(address, where it was found) of the cluster a plain `ray.init()` would join: RAY_ADDRESS,
    else Ray's state file in its default temp directory; None when neither names one."""
    if env := environ.get("RAY_ADDRESS", "").strip():
        return env, "RAY_ADDRESS"
    state = system_temp_dir(environ) / "ray" / STATE_FILE
    try:
        text = state.read_text().strip()
    except OSError:
        return None
    return (text, f"Ray's state file {state}") if text else None


def resolve_address(address: str, environ: Mapping[str, str]) -> str:
    """HOST:PORT for `address`, "auto" read as Ray reads it; ValueError naming --address when
    "auto" finds nothing or the address has no port."""
    if address == "auto":
        found = recorded_address(environ)
        if found is None:
            raise ValueError("--address auto: no RAY_ADDRESS and no Ray state file on this host; give HOST:PORT")
        address = found[0]
    host, sep, port = _without_scheme(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--address: {address!r} is not HOST:PORT")
    return address


def is_loopback_host(host: str) -> bool:
    """True when a bare host name or IP address is this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    """True when HOST:PORT (or a bare host) names this machine's loopback interface."""
    address = _without_scheme(address)
    host = address.rpartition(":")[0] if ":" in address else address
    return is_loopback_host(host.strip("[]"))


def answers(address: str, timeout_s: float = 0.5) -> bool:
    """True when something accepts a TCP connection at HOST:PORT within `timeout_s`."""
    host, _, port = _without_scheme(address).rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def running_cluster(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(address, where it was found) of a cluster that a plain `ray.init()` would have joined and
    whose GCS port answers; None when none is recorded or the record is stale."""
    found = recorded_address(environ)
    if found is None:
        return None
    try:
        address = resolve_address(found[0], environ)
    except ValueError:
        return None
    return (address, found[1]) if answers(address) else None


async def wait_until_answers(address: str, timeout_s: float, interval_s: float = 0.5) -> None:
    """Return once something listens at HOST:PORT; TimeoutError after `timeout_s`. Each try is a
    short connect on the event loop, so SIGINT/SIGTERM handlers run while it waits (Ray's own
    connect blocks every signal for tens of seconds at a time)."""
    host, _, port = _without_scheme(address).rpartition(":")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), interval_s)
        except (OSError, asyncio.TimeoutError):
            if loop.time() >= deadline:
                raise TimeoutError(f"nothing answered at {address} within {timeout_s:g} s") from None
            await asyncio.sleep(interval_s)
            continue
        writer.close()
        return


def one_machine_env(address: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """What must be in the environment before Ray is imported for a process that starts a local
    cluster (`address` None) or joins one at `address`: one-machine mode on loopback. Empty when
    the user set the variable, or for a cluster beyond loopback."""
    if ONE_MACHINE_VAR in environ:
        return {}
    if address is None:
        return {ONE_MACHINE_VAR: "0"}
    try:
        resolved = resolve_address(address, environ)
    except ValueError:
        return {}  # said with the error where the address is used
    return {ONE_MACHINE_VAR: "0"} if is_loopback(resolved) else {}



def _without_scheme(address: str) -> str:
    """HOST:PORT of an address that may name a scheme (Ray Client's ray://HOST:PORT)."""
    return address.split("://", 1)[-1]
