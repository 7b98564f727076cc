"""The port check `pdserve serve` runs before it starts anything."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pdserve.cluster.ports import PortInUseError, check_ports, port_free


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port held the way a gRPC server holds it: listening, with SO_REUSEPORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_a_port_held_by_a_reuseport_listener_is_taken(held_port):
    assert not port_free("127.0.0.1", held_port)
    assert port_free("127.0.0.1", 0)


def test_a_released_port_is_free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert port_free("127.0.0.1", port)


def test_check_ports_names_the_flag_and_the_port(held_port):
    check_ports("127.0.0.1", {"--port": 0, "--http-port": None})
    with pytest.raises(PortInUseError, match=f"^--http-port {held_port}: 127.0.0.1:{held_port} is already in use"):
        check_ports("127.0.0.1", {"--port": 0, "--http-port": held_port})
    # Two flags naming one port: refused by name whether or not something else holds it.
    with pytest.raises(PortInUseError, match=f"--metrics-port {held_port}: the same port as --http-port"):
        check_ports("127.0.0.1", {"--http-port": held_port, "--metrics-port": held_port})
