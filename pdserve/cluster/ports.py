"""Is a TCP port free to listen on? Checked for every port `pdserve serve` will open before Ray and
the worker pools start, so a port that is taken costs the user one line, not a minute of start-up.

The probe binds without SO_REUSEPORT: gRPC servers set that option by default, and a second
server binding with it would silently share the port (and its connections) with the first."""

from __future__ import annotations

import socket
from collections.abc import Mapping


class PortInUseError(OSError):
    """A port `pdserve serve` needs is taken; the message names the flag and the port."""


def port_free(host: str, port: int) -> bool:
    """True when a socket can listen on host:port (port 0, any free port, always can)."""
    if port == 0:
        return True
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as s:
            # SO_REUSEADDR as servers set it: a port whose last connections linger in TIME_WAIT is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
                s.listen(1)
            except OSError:
                return False
    return True


def check_ports(host: str, ports: Mapping[str, int | None]) -> None:
    """Raise PortInUseError naming the first taken port. ports: flag name -> port (None: not opened).
    Two flags naming one port are refused first: that is the command line's fault, whatever holds
    the port now."""
    fixed = {flag: port for flag, port in ports.items() if port}
    seen: dict[int, str] = {}
    for flag, port in fixed.items():
        if port in seen:
            raise PortInUseError(f"{flag} {port}: the same port as {seen[port]}")
        seen[port] = flag
    for flag, port in fixed.items():
        if not port_free(host, port):
            raise PortInUseError(
                f"{flag} {port}: {host}:{port} is already in use (another pdserve serve?); "
                f"stop it, or pick another port ({flag} 0 picks a free one)"
            )
