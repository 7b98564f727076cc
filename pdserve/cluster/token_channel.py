"""The token channel: a decode worker's `poll` over a plain TCP connection instead of a Ray call.

Why: the relay long-polls every decode worker once per engine step, and a Ray actor call costs
the router's process about 1 ms of CPU whatever it carries (submission, the hand-back of its
future into asyncio, Ray's I/O thread). Four GPU workers stepping every 2.5 ms are then more
than a core of the router's before a token is streamed. The same request and answer over a
connection the router keeps open cost a few tens of microseconds on each side.

The semantics are `DecodeWorker.poll`'s, unchanged: the request carries the router's id and the
last update it received (`acked`), so an answer lost with a connection is sent again on the next
poll. Only the transport differs.

Wire format (all integers big-endian):

- The worker sends ``MAGIC`` and a 16-byte nonce; the router answers with
  HMAC-SHA256(key, nonce). The key is a random 32 bytes per worker, handed to the router over Ray
  (whose own calls are authenticated), so only a process that may call the worker over Ray can
  open its channel, and the key itself never crosses the channel.
- A request: ``u32 length`` then ``f64 wait_s, i64 acked (-1: None), utf-8 router id``.
- An answer: ``u32 length, u8 status`` then a serialized `TokenUpdates` (status 0) or an error
  message (1: the worker has flipped to prefill, `WrongRole`; 2: its engine loop stopped,
  `EngineStopped`; 3: another error). Nothing on the channel is unpickled.

The worker serves each connection on a thread of its own (a poll blocks until its updates
come, as it does on Ray's threads); a router keeps one connection per poll in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.cluster.worker_host import WrongRole
from pdserve.engine.loop import EngineStopped
from pdserve_proto import worker_pb2

log = logging.getLogger(__name__)

MAGIC = b"PDTC1"
_NONCE = 16
_DIGEST = 32
_REQUEST = struct.Struct("!dq")
_LENGTH = struct.Struct("!I")
_ANSWER = struct.Struct("!IB")
_OK, _WRONG_ROLE, _ENGINE_STOPPED, _ERROR = 0, 1, 2, 3
# A request is a few dozen bytes: a larger length means a peer that does not speak this protocol.
_MAX_REQUEST = 4096
MAX_CONNECTIONS = 64  # routers x polls in flight: a few per router; the rest are refused
HANDSHAKE_TIMEOUT_S = 5.0

PollFn = Callable[[float, str, "int | None"], worker_pb2.TokenUpdates]


@dataclass(frozen=True)
class ChannelInfo:
    """Where a worker's channel listens, and the key that opens it (from the worker, over Ray)."""

    host: str
    port: int
    key: bytes


class ChannelUnavailable(Exception):
    """The channel itself failed (refused, reset, closed, bad handshake): not the worker's answer.
    The caller asks over Ray instead, which tells a dead worker from a lost connection."""


def _digest(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


# ----- the worker's side -----------------------------------------------------------------------


class TokenChannelServer:
    """Serves `poll` on `host`, a free port; `info()` says where and with which key."""

    def __init__(self, poll: PollFn, host: str, key: bytes | None = None) -> None:
        self._poll = poll
        self._key = key if key is not None else secrets.token_bytes(32)
        self._sock = socket.create_server((host, 0))
        self._host = host
        self._port = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="token-channel", daemon=True).start()

    def info(self) -> ChannelInfo:
        return ChannelInfo(self._host, self._port, self._key)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop listening and end every open connection (a router's poll then goes over Ray)."""
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                log.warning("token channel: %d connections open already; refusing one", MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="token-channel-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._handshake(conn):
                return
            while not self._closed:
                head = _recv_exact(conn, _LENGTH.size)
                if head is None:
                    return  # the router closed it
                (length,) = _LENGTH.unpack(head)
                if not _REQUEST.size <= length <= _MAX_REQUEST:
                    log.warning("token channel: a request of %d bytes; closing the connection", length)
                    return
                body = _recv_exact(conn, length)
                if body is None:
                    return
                wait_s, acked = _REQUEST.unpack_from(body)
                router_id = body[_REQUEST.size:].decode()
                status, payload = self._answer(wait_s, router_id, None if acked < 0 else acked)
                conn.sendall(_ANSWER.pack(len(payload), status) + payload)
        except OSError:
            pass  # the router went away mid-answer: it polls again, and `acked` resends what it missed
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        nonce = secrets.token_bytes(_NONCE)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        conn.sendall(MAGIC + nonce)
        answer = _recv_exact(conn, _DIGEST)
        if answer is None or not hmac.compare_digest(answer, _digest(self._key, nonce)):
            log.warning("token channel: a connection without the worker's key; closed")
            return False
        conn.settimeout(None)  # a poll may wait for its updates; a dead router closes the socket
        return True

    def _answer(self, wait_s: float, router_id: str, acked: int | None) -> tuple[int, bytes]:
        try:
            return _OK, self._poll(wait_s, router_id, acked).SerializeToString()
        except WrongRole as exc:
            return _WRONG_ROLE, str(exc).encode()
        except EngineStopped as exc:
            return _ENGINE_STOPPED, str(exc).encode()
        except Exception as exc:  # the router gets the worker's error, as over Ray
            return _ERROR, f"{type(exc).__name__}: {exc}".encode()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# ----- the router's side -----------------------------------------------------------------------


class TokenChannelClient:
    """Polls one worker over its channel. `fetch_info` asks the worker (over Ray) where its
    channel is; None there means the worker has none, and every poll raises
    `ChannelUnavailable` (the caller uses Ray). After a failed connection attempt the channel is
    not tried again for `retry_after_s`, so a port the network blocks costs one attempt, not one
    per poll."""

    def __init__(
        self,
        fetch_info: Callable[[], Awaitable[ChannelInfo | None]],
        connect_timeout_s: float = 2.0,
        retry_after_s: float = 5.0,
    ) -> None:
        self._fetch_info = fetch_info
        self._info: ChannelInfo | None = None
        self._none = False  # the worker said it has no channel
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._down_until = 0.0

    @property
    def usable(self) -> bool:
        return not self._none and time.monotonic() >= self._down_until

    async def poll(self, wait_s: float, router_id: str, acked: int | None) -> worker_pb2.TokenUpdates:
        conn = await self._take()
        reader, writer = conn
        done = False
        try:
            rid = router_id.encode()
            body = _REQUEST.pack(wait_s, -1 if acked is None else acked) + rid
            writer.write(_LENGTH.pack(len(body)) + body)
            head = await reader.readexactly(_ANSWER.size)
            length, status = _ANSWER.unpack(head)
            payload = await reader.readexactly(length)
            done = True
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise ChannelUnavailable(f"token channel: {type(exc).__name__}: {exc}") from exc
        finally:
            if done:
                self._idle.append(conn)
            else:  # failed or cancelled mid-call: its answer may still come, so the connection is unusable
                writer.close()
        if status == _OK:
            return worker_pb2.TokenUpdates.FromString(payload)
        message = payload.decode(errors="replace")
        if status == _WRONG_ROLE:
            raise WrongRole(message)
        if status == _ENGINE_STOPPED:
            raise EngineStopped(message)
        raise RuntimeError(message)

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def _take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        if not self.usable:
            raise ChannelUnavailable("token channel: not in use")
        try:
            return await asyncio.wait_for(self._connect(), self.connect_timeout_s)
        except ChannelUnavailable:
            raise
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            self._info = None  # a restarted worker listens elsewhere: ask it again next time
            self._down_until = time.monotonic() + self.retry_after_s
            log.info("token channel: cannot connect (%s: %s); polling over Ray for %gs",
                     type(exc).__name__, exc, self.retry_after_s)
            raise ChannelUnavailable(f"token channel: {type(exc).__name__}: {exc}") from exc

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._info is None:
            try:
                self._info = await self._fetch_info()
            except Exception as exc:  # a dead worker, or one that predates channels
                raise OSError(f"asking the worker where its channel is: {type(exc).__name__}: {exc}") from exc
            if self._info is None:
                self._none = True
                raise ChannelUnavailable("token channel: the worker has none")
        info = self._info
        reader, writer = await asyncio.open_connection(info.host, info.port)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = await reader.readexactly(len(MAGIC) + _NONCE)
            if not hello.startswith(MAGIC):
                raise OSError(f"not a token channel (greeting {hello[:len(MAGIC)]!r})")
            writer.write(_digest(info.key, hello[len(MAGIC):]))
        except BaseException:
            writer.close()
            raise
        return reader, writer
