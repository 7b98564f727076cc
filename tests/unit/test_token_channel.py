"""The token channel (`pdserve.cluster.token_channel`): a decode worker's `poll` over TCP, with the
worker's key, its errors, and a router that gives up on a call mid-way; and `RayWorker`'s
fall-back to Ray when the channel fails. Real sockets on loopback; the worker is a function
behind the worker's boundary (`WorkerBoundary`), as in a worker actor."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from pdserve.cluster.actors import RayWorker
from pdserve.cluster.token_channel import ChannelInfo, ChannelUnavailable, TokenChannelClient, TokenChannelServer
from pdserve.cluster.worker_boundary import WorkerBoundary
from pdserve.cluster.worker_host import WrongRole
from pdserve.engine.loop import EngineStopped
from pdserve_proto import worker_pb2


def _updates(*pairs: tuple[str, list[int]]) -> worker_pb2.TokenUpdates:
    return worker_pb2.TokenUpdates(
        updates=[worker_pb2.TokenUpdate(request_id=r, token_ids=t, seq=i + 1) for i, (r, t) in enumerate(pairs)]
    )


class Outbox:
    """Answers like `DecodeWorker.poll`: blocks until there is something, records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, int | None]] = []
        self.pending: list[worker_pb2.TokenUpdates] = []
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def poll(self, wait_s: float, router_id: str, acked: int | None) -> worker_pb2.TokenUpdates:
        with self.cond:
            self.calls.append((wait_s, router_id, acked))
            self.cond.wait_for(lambda: self.pending or self.error is not None, wait_s)
            if self.error is not None:
                raise self.error
            return self.pending.pop(0) if self.pending else worker_pb2.TokenUpdates()

    def put(self, updates: worker_pb2.TokenUpdates) -> None:
        with self.cond:
            self.pending.append(updates)
            self.cond.notify_all()


def _request(wait_s: float, router_id: str, acked: int | None) -> worker_pb2.PollRequest:
    return worker_pb2.PollRequest(wait_s=wait_s, router_id=router_id, acked=acked)


def _client(info: ChannelInfo | None, **kw: Any) -> TokenChannelClient:
    async def fetch() -> ChannelInfo | None:
        return info

    return TokenChannelClient(fetch, **kw)


@pytest.fixture
def served() -> Any:
    outbox = Outbox()
    server = TokenChannelServer(WorkerBoundary(outbox).poll, "127.0.0.1")
    yield outbox, server
    server.close()


def test_a_poll_round_trips_every_field(served: Any) -> None:
    outbox, server = served
    sent = _updates(("r1", [5, 6]), ("r2", [7]))
    sent.updates[1].finish_reason = "stop"
    outbox.put(sent)

    async def go() -> tuple[worker_pb2.TokenUpdates, worker_pb2.TokenUpdates]:
        client = _client(server.info())
        first = await client.poll(_request(0.5, "router-a", 41))
        second = await client.poll(_request(0.01, "router-b", None))  # nothing pending: an empty answer after the wait
        client.close()
        return first, second

    first, second = asyncio.run(go())
    assert first == sent
    assert list(second.updates) == []
    assert outbox.calls == [(0.5, "router-a", 41), (0.01, "router-b", None)]


def test_the_workers_errors_come_back_as_their_codes(served: Any) -> None:
    outbox, server = served

    async def poll() -> Any:
        client = _client(server.info())
        try:
            return await client.poll(_request(0.5, "r", None))
        finally:
            client.close()

    E = worker_pb2.WorkerError
    outbox.error = WrongRole("role: w is a prefill worker (epoch 1), not a decode worker")
    assert asyncio.run(poll()) == E(code=E.WRONG_ROLE, message=str(outbox.error))
    outbox.error = EngineStopped("engine loop stopped: boom")
    assert asyncio.run(poll()) == E(code=E.ENGINE_STOPPED, message="engine loop stopped: boom")
    outbox.error = ValueError("bad acked")
    assert asyncio.run(poll()) == E(code=E.INTERNAL, message="ValueError: bad acked")


def test_a_connection_without_the_key_gets_nothing(served: Any) -> None:
    outbox, server = served
    outbox.put(_updates(("secret-request", [1])))
    info = server.info()
    wrong = ChannelInfo(info.host, info.port, b"x" * 32)

    async def go() -> worker_pb2.TokenUpdates:
        with pytest.raises(ChannelUnavailable):
            await _client(wrong).poll(_request(0.2, "r", None))
        client = _client(info)  # the worker still serves those that have it
        try:
            return await client.poll(_request(0.2, "r", None))
        finally:
            client.close()

    assert asyncio.run(go()).updates[0].request_id == "secret-request"
    assert len(outbox.calls) == 1  # the keyless connection never reached `poll`


def test_a_stranger_speaking_another_protocol_is_dropped(served: Any) -> None:
    outbox, server = served
    info = server.info()
    with socket.create_connection((info.host, info.port), timeout=2) as s:
        greeting = s.recv(64)
        assert greeting.startswith(b"PDTC1")
        s.sendall(b"GET / HTTP/1.1\r\nHost: exampl\r\n\r\n")  # 32 bytes, not the key's digest
        assert s.recv(64) == b""  # closed
    assert outbox.calls == []


def test_a_poll_given_up_mid_way_never_answers_the_next_one(served: Any) -> None:
    """A poll cancelled by its deadline leaves its answer in flight: that connection must not
    be reused, or the next poll would read the late answer as its own."""
    outbox, server = served

    async def go() -> worker_pb2.TokenUpdates:
        client = _client(server.info())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await client.poll(_request(1.0, "r", None))  # the worker holds it: nothing pending
        outbox.put(_updates(("late", [1])))  # answers the abandoned poll
        await asyncio.sleep(0.2)
        outbox.put(_updates(("next", [2])))
        try:
            return await client.poll(_request(1.0, "r", 1))
        finally:
            client.close()

    assert [u.request_id for u in asyncio.run(go()).updates] == ["next"]


def test_no_channel_or_a_refused_one_is_unavailable_and_not_retried_at_once() -> None:
    async def go() -> None:
        none = _client(None)
        with pytest.raises(ChannelUnavailable):
            await none.poll(_request(0.1, "r", None))
        assert not none.usable

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        refused = _client(ChannelInfo("127.0.0.1", port, b"k" * 32), retry_after_s=30.0)
        with pytest.raises(ChannelUnavailable):
            await refused.poll(_request(0.1, "r", None))
        assert not refused.usable  # the caller goes over Ray until the retry time

    asyncio.run(go())


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.fn(*args)

        return call()


class _FakeActor:
    """A `WorkerActor` as `RayWorker` sees it: methods with `.remote`."""

    def __init__(self, info: ChannelInfo | None) -> None:
        self.ray_polls: list[tuple[Any, ...]] = []
        self.token_channel = _Method(lambda: info)
        self.poll = _Method(self._poll)

    def _poll(self, request: worker_pb2.PollRequest) -> worker_pb2.TokenUpdates:
        self.ray_polls.append((request.wait_s, request.router_id, request.acked if request.HasField("acked") else None))
        return _updates(("over-ray", [9]))


def test_the_transport_polls_over_the_channel_and_falls_back_to_ray(served: Any) -> None:
    outbox, server = served
    actor = _FakeActor(server.info())
    worker = RayWorker(actor)

    async def go() -> tuple[list[str], list[str], list[str]]:
        outbox.put(_updates(("over-channel", [1])))
        first = await worker.poll(_request(0.5, "router", None))
        server.close()  # the channel goes away (and its open connection with it)
        await asyncio.sleep(0.05)
        second = await worker.poll(_request(0.5, "router", 1))
        third = await worker.poll(_request(0.5, "router", 1))  # the refused reconnect is not retried at once
        return ([u.request_id for u in first.updates], [u.request_id for u in second.updates],
                [u.request_id for u in third.updates])

    assert asyncio.run(go()) == (["over-channel"], ["over-ray"], ["over-ray"])
    assert actor.ray_polls == [(0.5, "router", 1), (0.5, "router", 1)]

    without = _FakeActor(None)  # a worker started with --token-transport ray
    answer = asyncio.run(RayWorker(without).poll(_request(0.1, "r", None)))
    assert answer.updates[0].request_id == "over-ray" and len(without.ray_polls) == 1


def test_a_request_of_impossible_length_closes_the_connection(served: Any) -> None:
    import hashlib
    import hmac
    import struct

    outbox, server = served
    info = server.info()
    with socket.create_connection((info.host, info.port), timeout=2) as s:
        greeting = s.recv(64)
        s.sendall(hmac.new(info.key, greeting[len(b"PDTC1"):], hashlib.sha256).digest())
        s.sendall(struct.pack("!I", 1 << 20))  # a megabyte: no poll request is that long
        assert s.recv(64) == b""  # closed
    assert outbox.calls == []


def test_an_unknown_token_transport_is_refused() -> None:
    from pdserve.cluster.serve_config import ServeConfig

    with pytest.raises(ValueError, match="token_transport"):
        ServeConfig(token_transport="grpc")
