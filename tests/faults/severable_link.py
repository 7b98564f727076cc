"""A TCP forwarder between the fault harness's clients and one router's gRPC server, which can
be cut as a killed process's sockets are: every connection reset at once, the port closed.

Stopping an in-process gRPC server is not what its clients see when the process dies: a call
that arrives while the server is shutting down is refused with RST_STREAM(CANCEL), which the
client reads as CANCELLED. A dead process's kernel resets its connections instead, and the
client reads UNAVAILABLE. The harness kills a router by severing this link first, then stops
the server behind it, which nobody can reach any more."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

_CHUNK = 1 << 16


class SeverableLink:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream_port` on the running event loop."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            _reset(client_w)
            return
        self._writers.add(up_w)
        for src, dst in ((client_r, up_w), (up_r, client_w)):
            task = asyncio.ensure_future(_pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def sever(self) -> None:
        """On the loop's thread: reset every connection (the peers read ECONNRESET, not an
        orderly close) and stop listening (later connects are refused)."""
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            _reset(w)
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        if not dst.is_closing():
            dst.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:  # linger 0: close() sends RST, as a killed process's kernel does
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
