"""Fuzz of the token channel: thousands of random and mutated frames, before the handshake and
after it. Every frame gets a well-formed answer or the connection closed, in time; none leaves
a thread spinning or the worker unable to answer a real poll afterwards.

Seeded (PDSERVE_FUZZ_SEED) and sized for CI; PDSERVE_FUZZ_SCALE=100 runs the nightly size."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import random
import socket
import struct
import threading
import time
from typing import Any

import pytest

from pdserve.cluster import token_channel
from pdserve.cluster.token_channel import ChannelInfo, TokenChannelServer
from pdserve.cluster.worker_boundary import WorkerBoundary
from pdserve_proto import worker_pb2
from tests.unit.token_channel_peer import open_channel, real_poll, receive

SCALE = int(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))
SEED = int(os.environ.get("PDSERVE_FUZZ_SEED", "20261127"))
FRAMES = 10000 * SCALE  # after the handshake
HANDSHAKES = 1000 * SCALE
ANSWER_WITHIN_S = 2.0
E = worker_pb2.WorkerError


class Outbox:
    """The decode worker's poll as far as waiting goes (a condition waited on for the request's
    own wait), kept short so that thousands of frames fit the test's time."""

    def __init__(self) -> None:
        self.cond = threading.Condition()

    def poll(self, wait_s: float, router_id: str, acked: int | None) -> worker_pb2.TokenUpdates:
        with self.cond:
            self.cond.wait_for(lambda: False, min(wait_s, 0.001) if math.isfinite(wait_s) else wait_s)
        return worker_pb2.TokenUpdates(updates=[worker_pb2.TokenUpdate(request_id="r", token_ids=[1], seq=1)])


def _valid(rng: random.Random) -> bytes:
    wait = rng.choice([0.0, 0.001, 0.05, math.nan, math.inf, -1.0, 1e308, -0.0, 5e-324, 61.0])
    request = worker_pb2.PollRequest(wait_s=wait, router_id=rng.choice(["", "router-a", "r" * 300, "é" * 10]))
    if rng.random() < 0.5:
        request.acked = rng.choice([0, 1, 2**63, 2**64 - 1])
    return request.SerializeToString()


def _mutated(rng: random.Random) -> bytes:
    body = bytearray(_valid(rng))
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        at = rng.randrange(len(body) + 1)
        if op == 0 and body:
            body[min(at, len(body) - 1)] ^= 1 << rng.randrange(8)  # a flipped bit
        elif op == 1:
            body[at:at] = rng.randbytes(rng.randint(1, 8))  # inserted bytes
        elif op == 2:
            del body[at:at + rng.randint(1, 4)]  # dropped bytes
        elif op == 3:
            body[at:at] = rng.choice([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x0a\x05\xff\xff\xff\xff\xff"])
        else:
            body[at:at] = struct.pack("<Bd", 0x09, rng.choice([math.nan, math.inf, -math.inf]))  # a wait_s field
    return bytes(body)


def _frame(rng: random.Random) -> bytes:
    """A length prefix and a body: mostly right, sometimes lying about the length."""
    kind = rng.random()
    body = _mutated(rng) if kind < 0.6 else _valid(rng) if kind < 0.8 else rng.randbytes(rng.randint(0, 64))
    length = len(body)
    if rng.random() < 0.05:
        length = rng.choice([len(body) + rng.randint(1, 16), token_channel._MAX_REQUEST + 1, 2**32 - 1])
    return struct.pack("!I", length) + body


def _recv(s: socket.socket, n: int) -> bytes | None:
    got = receive(s, n)
    return got if len(got) == n else None


def _open(info: ChannelInfo) -> socket.socket:
    return open_channel(info, timeout_s=ANSWER_WITHIN_S)


def _send_one(s: socket.socket, frame: bytes) -> bool:
    """Send `frame`; True if the server answered it (well-formed), False if it closed the
    connection. A hang past ANSWER_WITHIN_S raises TimeoutError."""
    (length,) = struct.unpack("!I", frame[:4])
    short = length != len(frame) - 4
    try:
        s.sendall(frame)
        if short and length <= token_channel._MAX_REQUEST:  # it waits for the rest: this sender gives up
            return False
        head = _recv(s, 5)
    except (ConnectionResetError, BrokenPipeError):
        return False
    if head is None:
        return False
    size, kind = struct.unpack("!IB", head)
    payload = _recv(s, size)
    assert payload is not None and kind in (0, 1), (kind, size)
    if kind == 1:
        error = E.FromString(payload)
        assert error.code in (E.INVALID_REQUEST,), error  # the sender's fault, never ours
    else:
        worker_pb2.TokenUpdates.FromString(payload)
    return True


def _healthy(server: TokenChannelServer, threads: int) -> None:
    """A real poll answers, every fuzz connection is gone, and nothing spins."""
    info = server.info()
    assert isinstance(real_poll(info), worker_pb2.TokenUpdates)
    deadline = time.monotonic() + 5
    while (server.connections or threading.active_count() > threads) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.connections == 0 and threading.active_count() <= threads, (server.connections, threading.active_count())
    began = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - began < 0.3  # a spinning thread would take about the whole second


@pytest.fixture
def served() -> Any:
    server = TokenChannelServer(WorkerBoundary(Outbox()).poll, "127.0.0.1")
    threads = threading.active_count()
    yield server, threads
    server.close()


def test_random_and_mutated_frames_after_the_handshake_are_answered_or_closed(served: Any) -> None:
    server, threads = served
    rng = random.Random(SEED)
    info = server.info()
    answered = closed = 0
    s = _open(info)
    try:
        for _ in range(FRAMES):
            if _send_one(s, _frame(rng)):
                answered += 1
            else:
                closed += 1
                s.close()
                s = _open(info)
    finally:
        s.close()
    assert answered > FRAMES // 2 and closed > 0, (answered, closed)  # the fuzz reached both ends
    _healthy(server, threads)


def test_random_bytes_in_place_of_the_handshake_are_closed(served: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(token_channel, "HANDSHAKE_TIMEOUT_S", 0.5)
    server, threads = served
    rng = random.Random(SEED + 1)
    info = server.info()
    for _ in range(HANDSHAKES):
        with socket.create_connection((info.host, info.port), timeout=ANSWER_WITHIN_S) as s:
            greeting = _recv(s, len(token_channel.MAGIC) + 16)
            assert greeting is not None and greeting.startswith(token_channel.MAGIC)
            junk = rng.randbytes(rng.choice([0, 1, 31, 32, 33, 64]))
            if rng.random() < 0.1:  # the right digest of another nonce: still not the key's answer
                junk = hmac.new(info.key, rng.randbytes(16), hashlib.sha256).digest()
            s.sendall(junk)
            if len(junk) < 32:
                s.shutdown(socket.SHUT_WR)  # else it waits out the handshake's bound, by design
            try:
                got = _recv(s, 1)
            except ConnectionResetError:
                got = None
            assert got is None  # closed, with nothing sent
    _healthy(server, threads)
