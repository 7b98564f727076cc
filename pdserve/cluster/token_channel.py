"""The token channel: worker.proto's `Poll` of a decode worker over a TCP connection the router
keeps open, instead of a Ray actor call, which costs the router's process about 1 ms of CPU
whatever it carries. Only the transport differs: a `PollRequest` in, the `TokenUpdates` or the
`WorkerError` the worker would answer over Ray out. The worker serves each connection on a
thread of its own (a poll blocks until its updates come); a router keeps one connection per
poll in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve_proto import worker_pb2

log = logging.getLogger(__name__)

# Wire format (integers big-endian). The worker sends MAGIC and a 16-byte nonce; the router
# answers HMAC-SHA256(key, nonce). The key is 32 random bytes per worker, handed to the router
# over Ray (whose calls are authenticated), so only a process that may call the worker over Ray
# opens its channel, and the key never crosses it. Then a request is `u32 length` and a
# serialized `PollRequest`; an answer `u32 length, u8 kind` and a serialized `TokenUpdates`
# (kind 0) or `WorkerError` (kind 1). Nothing on the channel is unpickled.
MAGIC = b"PDTC1"
_NONCE = 16
_DIGEST = 32
_LENGTH = struct.Struct("!I")
_ANSWER = struct.Struct("!IB")
_UPDATES, _ERROR = 0, 1
# A request is a few dozen bytes: a larger length means a peer that does not speak this protocol.
_MAX_REQUEST = 4096
MAX_CONNECTIONS = 64  # routers x polls in flight: a few per router; the rest are refused
# A handshake gets this long in all (not per byte), and only so many run at once, a few per peer
# address: connections that never prove the key cannot hold a slot for long nor fill the table.
HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 16
MAX_HANDSHAKES_PER_PEER = 4
# A poll's longest wait: routers long-poll for a fraction of a second.
MAX_WAIT_S = 60.0
_MAX_ROUTER_ID = 256

# The worker's `Poll` (`pdserve.cluster.worker_boundary.WorkerBoundary.poll`): it answers its
# errors as `WorkerError`s rather than raising them.
PollFn = Callable[[worker_pb2.PollRequest], "worker_pb2.TokenUpdates | worker_pb2.WorkerError"]


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
        self._handshakes: dict[str, int] = {}  # peer address -> handshakes under way
        self._served = 0  # connections past their handshake
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
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            peer = str(addr[0])
            with self._lock:
                shaking = self._handshakes.get(peer, 0)
                full = sum(self._handshakes.values()) >= MAX_HANDSHAKES or shaking >= MAX_HANDSHAKES_PER_PEER
                if not full:
                    self._handshakes[peer] = shaking + 1
                    self._conns.add(conn)
            if full:
                log.warning("token channel: too many handshakes under way (from %s); refusing one", peer)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="token-channel-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        shaking, admitted = True, False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            shook = self._handshake(conn)
            shaking = False  # `_admit` ends its count
            admitted = self._admit(peer, shook)
            while admitted and not self._closed:
                head = _recv_exact(conn, _LENGTH.size)
                if head is None:
                    return  # the router closed it
                (length,) = _LENGTH.unpack(head)
                if length > _MAX_REQUEST:
                    log.warning("token channel: a request of %d bytes; closing the connection", length)
                    return
                body = _recv_exact(conn, length)
                if body is None:
                    return
                kind, payload = self._answer(body)
                conn.sendall(_ANSWER.pack(len(payload), kind) + payload)
        except OSError:
            pass  # the router went away mid-answer: it polls again, and `acked` resends what it missed
        except Exception:  # a fault of ours: this connection ends, the worker and its other ones go on
            log.exception("token channel: serving a connection failed; closing it")
        finally:
            with self._lock:
                self._conns.discard(conn)
                if admitted:
                    self._served -= 1
                elif shaking:
                    self._release_handshake(peer)
            conn.close()

    def _admit(self, peer: str, shook: bool) -> bool:
        """The handshake of `peer` is over: its connection takes a slot if it passed and one is free."""
        with self._lock:
            self._release_handshake(peer)
            if not shook:
                return False
            if self._served >= MAX_CONNECTIONS:
                log.warning("token channel: %d connections open already; refusing one", MAX_CONNECTIONS)
                return False
            self._served += 1
            return True

    def _release_handshake(self, peer: str) -> None:
        left = self._handshakes.pop(peer, 0) - 1
        if left > 0:
            self._handshakes[peer] = left

    def _handshake(self, conn: socket.socket) -> bool:
        nonce = secrets.token_bytes(_NONCE)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn.sendall(MAGIC + nonce)
            answer = _recv_exact(conn, _DIGEST, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except TimeoutError:
            answer = None
        if answer is None or not hmac.compare_digest(answer, _digest(self._key, nonce)):
            log.warning("token channel: a connection without the worker's key; closed")
            return False
        conn.settimeout(None)  # a poll may wait for its updates; a dead router closes the socket
        return True

    def _answer(self, body: bytes) -> tuple[int, bytes]:
        try:
            request = worker_pb2.PollRequest.FromString(body)
            problem = poll_problem(request)
        except Exception as exc:  # not a PollRequest (bad UTF-8 included): the sender's fault
            problem = f"not a PollRequest: {type(exc).__name__}: {exc}"
        if problem is not None:
            answer = worker_pb2.WorkerError(
                code=worker_pb2.WorkerError.INVALID_REQUEST, message=f"token channel: {problem}"
            )
        else:
            try:
                answer = self._poll(request)
            except Exception as exc:  # the poll answers its own errors: this is a fault of ours
                log.exception("token channel: the poll failed")
                answer = worker_pb2.WorkerError(
                    code=worker_pb2.WorkerError.INTERNAL, message=f"token channel: {type(exc).__name__}"
                )
        kind = _ERROR if isinstance(answer, worker_pb2.WorkerError) else _UPDATES
        return kind, answer.SerializeToString()


def poll_problem(request: worker_pb2.PollRequest) -> str | None:
    """What is wrong with a poll from the wire, or None. A NaN or infinite wait would make the
    worker's wait spin or never end."""
    if not math.isfinite(request.wait_s) or not 0.0 <= request.wait_s <= MAX_WAIT_S:
        return f"wait_s: {request.wait_s}; must be finite, within [0, {MAX_WAIT_S:g}]"
    if len(request.router_id) > _MAX_ROUTER_ID:
        return f"router_id: {len(request.router_id)} characters; at most {_MAX_ROUTER_ID}"
    return None


def _recv_exact(conn: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """`n` bytes, or None if the peer closed first. With `deadline` (monotonic), TimeoutError
    once it passes, however the bytes trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("token channel: handshake past its time")
            conn.settimeout(left)
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

    async def poll(self, request: worker_pb2.PollRequest) -> worker_pb2.TokenUpdates | worker_pb2.WorkerError:
        conn = await self._take()
        reader, writer = conn
        done = False
        try:
            body = request.SerializeToString()
            writer.write(_LENGTH.pack(len(body)) + body)
            head = await reader.readexactly(_ANSWER.size)
            length, kind = _ANSWER.unpack(head)
            payload = await reader.readexactly(length)
            done = True
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise ChannelUnavailable(f"token channel: {type(exc).__name__}: {exc}") from exc
        finally:
            if done:
                self._idle.append(conn)
            else:  # failed or cancelled mid-call: its answer may still come, so the connection is unusable
                writer.close()
        if kind == _ERROR:
            return worker_pb2.WorkerError.FromString(payload)
        return worker_pb2.TokenUpdates.FromString(payload)

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
