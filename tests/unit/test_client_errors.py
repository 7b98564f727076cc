"""What clients are told when something fails: a short message and a status, never a worker
host's traceback or terminal colours; unknown HTTP routes answer in the OpenAI error shape."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import ray.exceptions
from aiohttp.test_utils import TestClient, TestServer

from pdserve.cluster.worker_client import WorkerClient
from pdserve.engine.block_manager import NoFreeBlocksError
from router.errors import short_reason, to_router_error
from router.handles import RouterError
from router.http_server import build_app

_RAY_TRACEBACK = (
    "\x1b[36mray::WorkerActor.start()\x1b[39m (pid=123, ip=127.0.0.1, actor_id=abc)\n"
    '  File "decode_worker/worker.py", line 10, in start\n'
    "pdserve.engine.block_manager.NoFreeBlocksError: need 9 blocks, 2 free"
)


def _ray_wrapped(cause: BaseException) -> BaseException:
    """The exception a Ray actor call raises in the caller for `cause` raised in the actor."""
    return ray.exceptions.RayTaskError("WorkerActor.start", _RAY_TRACEBACK, cause).as_instanceof_cause()


def test_a_ray_wrapped_error_is_shortened_to_the_workers_own_first_line():
    wrapped = _ray_wrapped(ValueError("sampling_params.top_p: must be in (0, 1], got 2.0\nmore detail"))
    assert isinstance(wrapped, ValueError) and "\x1b[" in str(wrapped)
    assert short_reason(wrapped) == "sampling_params.top_p: must be in (0, 1], got 2.0"
    err = to_router_error(wrapped, "decode start")
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "sampling_params.top_p: must be in (0, 1], got 2.0"


def test_no_free_blocks_from_a_ray_worker_reaches_the_client_without_ray_internals():
    async def fails(name: str, *args: object) -> object:
        raise _ray_wrapped(NoFreeBlocksError("need 9 blocks, 2 free"))

    client = WorkerClient("d0", fails)
    with pytest.raises(RouterError) as err:
        asyncio.run(client.submit([1, 2, 3], None, "r1", 5.0))  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == "decode submit: no free KV blocks; retry later"
    assert not err.value.worker_failed


def test_a_call_for_the_role_a_worker_left_moves_the_request_elsewhere():
    from pdserve.cluster.worker_host import WrongRole

    async def flipped(name: str, *args: object) -> object:
        raise _ray_wrapped(WrongRole("role: p0 is a decode worker (epoch 1), not a prefill worker"))

    with pytest.raises(RouterError) as err:
        asyncio.run(WorkerClient("p0", flipped).prefill([1, 2, 3], None, "r1", 5.0))  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.worker_failed
    assert "epoch 1" in err.value.message and "\x1b[" not in err.value.message


def test_an_unexpected_error_names_its_type_not_its_host():
    err = to_router_error(_ray_wrapped(RuntimeError("engine loop stopped")), "prefill")
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert err.message == "prefill: RuntimeError: engine loop stopped"


def test_a_very_long_reason_is_cut():
    assert len(short_reason(RuntimeError("x" * 5000))) == 300


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/v1/no-such-route", 404, "Invalid URL (GET /v1/no-such-route)"),
        ("POST", "/v2/completions", 404, "Invalid URL (POST /v2/completions)"),
        ("GET", "/v1/completions", 405, "Method GET not allowed for /v1/completions"),
    ],
)
def test_unknown_routes_answer_in_the_openai_error_shape(method, path, status, message):
    async def go() -> tuple[int, dict]:
        # Unknown routes never reach the router, so none is needed behind the app.
        async with TestClient(TestServer(build_app(None))) as client:  # type: ignore[arg-type]
            resp = await client.request(method, path)
            return resp.status, await resp.json()

    got_status, body = asyncio.run(go())
    assert got_status == status
    assert body == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
