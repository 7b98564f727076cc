"""A peer of the token channel for its tests: raw frames over a socket, the handshake, and a real
poll through the product's client (the proof that a server still serves after abuse)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
from typing import Any

from pdserve.cluster import token_channel
from pdserve.cluster.token_channel import ChannelInfo, TokenChannelClient
from pdserve_proto import worker_pb2


def receive(s: socket.socket, n: int) -> bytes:
    """Up to n bytes: fewer only when the server closed the connection first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return buf
        buf += chunk
    return buf


def open_channel(info: ChannelInfo, source: str = "127.0.0.1", timeout_s: float = 5.0) -> socket.socket:
    """A connection past the handshake."""
    s = socket.create_connection((info.host, info.port), timeout=timeout_s, source_address=(source, 0))
    greeting = receive(s, len(token_channel.MAGIC) + 16)
    s.sendall(hmac.new(info.key, greeting[len(token_channel.MAGIC):], hashlib.sha256).digest())
    return s


def real_poll(info: ChannelInfo) -> worker_pb2.TokenUpdates | worker_pb2.WorkerError:
    async def fetch() -> ChannelInfo:
        return info

    async def go() -> Any:
        client = TokenChannelClient(fetch)
        try:
            return await client.poll(worker_pb2.PollRequest(wait_s=0.01, router_id="router-a"))
        finally:
            client.close()

    return asyncio.run(go())
