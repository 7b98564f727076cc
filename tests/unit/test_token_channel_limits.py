"""The token channel takes nothing from the wire on trust: a poll's wait must be finite and
bounded (a NaN wait once spun a worker thread forever), a request that does not parse (bad
UTF-8 included) gets an INVALID_REQUEST answer, a handshake has a bound on its total time
however slowly its bytes come, and peers that never prove the key cannot fill the connection
table. Real sockets on loopback; the worker's poll waits as `DecodeWorker.poll` does, on a
condition with the request's own wait."""

from __future__ import annotations

import math
import socket
import struct
import threading
import time
from typing import Any

import pytest

from pdserve.cluster import token_channel
from pdserve.cluster.token_channel import TokenChannelServer
from pdserve.cluster.worker_boundary import WorkerBoundary
from pdserve_proto import worker_pb2
from tests.unit.token_channel_peer import open_channel, real_poll, receive

E = worker_pb2.WorkerError


class Waiting:
    """A poll that waits on a condition for its request's `wait_s`, as the decode worker's does."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.calls = 0

    def poll(self, request: worker_pb2.PollRequest) -> worker_pb2.TokenUpdates:
        self.calls += 1
        with self.cond:
            self.cond.wait_for(lambda: False, request.wait_s)
        return worker_pb2.TokenUpdates(updates=[worker_pb2.TokenUpdate(request_id="r", token_ids=[7], seq=1)])


@pytest.fixture
def served() -> Any:
    worker = Waiting()
    server = TokenChannelServer(worker.poll, "127.0.0.1")
    yield worker, server
    server.close()


def _ask(s: socket.socket, body: bytes) -> tuple[int, bytes]:
    s.sendall(struct.pack("!I", len(body)) + body)
    length, kind = struct.unpack("!IB", receive(s, 5))
    return kind, receive(s, length)


def _cpu_over(seconds: float) -> float:
    began = time.process_time()
    time.sleep(seconds)
    return time.process_time() - began


@pytest.mark.parametrize("wait_s", [math.nan, math.inf, -math.inf, -1.0, token_channel.MAX_WAIT_S * 2, 1e300])
def test_a_poll_with_a_wait_that_is_not_finite_and_bounded_gets_an_error_and_nothing_spins(
    served: Any, wait_s: float
) -> None:
    worker, server = served
    info = server.info()
    threads = threading.active_count()
    with open_channel(info) as s:
        kind, payload = _ask(s, worker_pb2.PollRequest(wait_s=wait_s, router_id="router-a").SerializeToString())
        assert kind == 1
        error = E.FromString(payload)
        assert error.code == E.INVALID_REQUEST and "wait_s" in error.message, error
        assert worker.calls == 0  # refused before the worker's poll
        assert threading.active_count() <= threads + 1  # this connection's thread, nothing more
        assert _cpu_over(1.0) < 0.3  # a spinning thread would take about the whole second
    assert isinstance(real_poll(info), worker_pb2.TokenUpdates)


def test_the_workers_boundary_refuses_such_a_wait_too() -> None:
    """Over Ray the poll reaches the worker's boundary without the channel's check."""

    class Outbox:
        worker_id = "w"

        def poll(self, wait_s: float, router_id: str, acked: int | None) -> worker_pb2.TokenUpdates:
            raise AssertionError("a bad wait reached the worker's poll")

        def kv_events(self, wait_s: float, full: bool, router_id: str) -> worker_pb2.KvEventBatch:
            raise AssertionError("a bad wait reached the worker's kv_events")

    boundary = WorkerBoundary(Outbox())
    for wait_s in (math.nan, math.inf, -0.5, 1e9):
        answer = boundary.poll(worker_pb2.PollRequest(wait_s=wait_s, router_id="r"))
        assert isinstance(answer, E) and answer.code == E.INVALID_REQUEST, answer
        answer = boundary.kv_events(worker_pb2.KvEventsRequest(wait_s=wait_s, router_id="r"))
        assert isinstance(answer, E) and answer.code == E.INVALID_REQUEST, answer


def test_bad_utf8_gets_an_invalid_request_answer_and_the_connection_serves_on(served: Any) -> None:
    _, server = served
    good = worker_pb2.PollRequest(wait_s=0.0, router_id="ab").SerializeToString()
    bad = good.replace(b"ab", b"\xff\xfe")
    with open_channel(server.info()) as s:
        kind, payload = _ask(s, bad)
        assert kind == 1 and E.FromString(payload).code == E.INVALID_REQUEST
        kind, payload = _ask(s, good)  # the same connection answers a good poll
        assert kind == 0 and worker_pb2.TokenUpdates.FromString(payload).updates[0].token_ids == [7]


def test_an_overlong_router_id_is_refused(served: Any) -> None:
    _, server = served
    with open_channel(server.info()) as s:
        kind, payload = _ask(s, worker_pb2.PollRequest(wait_s=0.0, router_id="x" * 1000).SerializeToString())
        assert kind == 1 and E.FromString(payload).code == E.INVALID_REQUEST


def test_a_handshake_that_trickles_in_is_cut_off_at_its_total_bound(served: Any, monkeypatch: Any) -> None:
    """One byte every 0.3 s would keep a per-read timeout of 1 s waiting for ever."""
    monkeypatch.setattr(token_channel, "HANDSHAKE_TIMEOUT_S", 1.0)
    _, server = served
    info = server.info()
    with socket.create_connection((info.host, info.port), timeout=5) as s:
        receive(s, len(token_channel.MAGIC) + 16)
        began = time.monotonic()
        closed_after = None
        for _ in range(31):  # one byte short of the digest's 32, then one more
            try:
                s.sendall(b"x")
                s.settimeout(0.3)
                if s.recv(1) == b"":
                    closed_after = time.monotonic() - began
                    break
            except TimeoutError:
                continue
            except OSError:
                closed_after = time.monotonic() - began
                break
        assert closed_after is not None and closed_after < 1.0 + 0.6, closed_after
    assert server.connections == 0


def test_peers_without_the_key_cannot_fill_the_table(served: Any) -> None:
    """Handshakes under way are few, and fewer per peer address: a peer that opens many gets
    the rest closed at once, and others (with the key) still connect and poll."""
    _, server = served
    info = server.info()
    strangers = []
    for _ in range(token_channel.MAX_HANDSHAKES_PER_PEER + 6):
        s = socket.create_connection((info.host, info.port), timeout=2, source_address=("127.0.0.2", 0))
        strangers.append(s)
    greeted = 0
    for s in strangers:
        if receive(s, len(token_channel.MAGIC) + 16).startswith(token_channel.MAGIC):
            greeted += 1
    assert greeted == token_channel.MAX_HANDSHAKES_PER_PEER
    answer = real_poll(info)  # from 127.0.0.1, with the key, while the strangers hang on
    assert isinstance(answer, worker_pb2.TokenUpdates), answer
    for s in strangers:
        s.close()
