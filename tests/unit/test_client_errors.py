"""What clients are told when something fails: a short message and a status, never a worker
host's traceback or terminal colours; unknown HTTP routes answer in the OpenAI error shape."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import ray.exceptions
from aiohttp.test_utils import TestClient, TestServer

from pdserve.cluster.worker_boundary import WorkerBoundary, local_worker
from pdserve.cluster.worker_client import WorkerClient
from pdserve.cluster.worker_host import WrongRole
from pdserve.engine.block_manager import NoFreeBlocksError
from pdserve.kv_transfer.compat import KvCompatError
from pdserve.router.edge.http_server import build_app
from pdserve.router.errors import short_reason, to_router_error
from pdserve.router.handles import RouterError
from pdserve_proto import worker_pb2

_RAY_TRACEBACK = (
    "\x1b[36mray::WorkerActor.start()\x1b[39m (pid=123, ip=127.0.0.1, actor_id=abc)\n"
    '  File "decode_worker/worker.py", line 10, in start\n'
    "pdserve.engine.block_manager.NoFreeBlocksError: need 9 blocks, 2 free"
)


def _ray_wrapped(cause: BaseException) -> BaseException:
    """The exception a Ray actor call raises in the caller for `cause` raised in the actor."""
    return ray.exceptions.RayTaskError("WorkerActor.start", _RAY_TRACEBACK, cause).as_instanceof_cause()


_PARAMS = worker_pb2.WorkerSamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=-1)


class _Raises:
    """A worker (either role) whose every call raises `exc`."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.worker_id = "w0"

    def __getattr__(self, name: str):
        def call(*args: object) -> object:
            raise self.exc

        return call


def _fails(exc: BaseException) -> WorkerClient:
    return WorkerClient("w0", local_worker(_Raises(exc)))


def _submit(client: WorkerClient, params: worker_pb2.WorkerSamplingParams = _PARAMS) -> object:
    request = worker_pb2.SubmitRequest(prompt_token_ids=[1, 2, 3], params=params, request_id="r1")
    return asyncio.run(client.submit(request, 5.0))


def _prefill(client: WorkerClient) -> object:
    request = worker_pb2.PrefillRequest(prompt_token_ids=[1, 2, 3], params=_PARAMS, request_id="r1")
    return asyncio.run(client.prefill(request, 5.0))


def test_a_ray_wrapped_error_is_shortened_to_its_own_first_line():
    wrapped = _ray_wrapped(RuntimeError("object store full\nmore detail"))
    assert "\x1b[" in str(wrapped)
    assert short_reason(wrapped) == "object store full"


def test_no_free_blocks_reaches_the_client_as_a_retry_later():
    with pytest.raises(RouterError) as err:
        _submit(_fails(NoFreeBlocksError("need 9 blocks, 2 free")))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == "decode submit: no free KV blocks; retry later"
    assert not err.value.worker_failed


def test_a_call_for_the_role_a_worker_left_moves_the_request_elsewhere():
    with pytest.raises(RouterError) as err:
        _prefill(_fails(WrongRole("role: p0 is a decode worker (epoch 1), not a prefill worker")))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.worker_failed
    assert "epoch 1" in err.value.message


def test_incompatible_kv_is_a_deployment_fault_not_the_clients():
    # KvCompatError is a ValueError: it must not fall under the generic ValueError rule.
    with pytest.raises(RouterError) as err:
        _submit(_fails(KvCompatError("kv layout: 32 layers here, 28 there")))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and not err.value.worker_failed


def test_a_generic_value_error_inside_a_worker_is_the_servers_fault():
    with pytest.raises(RouterError) as err:
        _submit(_fails(ValueError("request_id: 'r1' is already in use\nmore detail")))
    assert err.value.code == grpc.StatusCode.INTERNAL and not err.value.worker_failed
    assert err.value.message == "decode submit: ValueError: request_id: 'r1' is already in use"


def test_invalid_params_in_the_request_are_the_clients_fault():
    bad = worker_pb2.WorkerSamplingParams(max_tokens=4, temperature=0.0, top_p=2.0, top_k=-1)
    with pytest.raises(RouterError) as err:
        _submit(_fails(AssertionError("never called")), bad)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "params.top_p: must be in (0, 1], got 2.0"


@pytest.mark.parametrize(
    ("exc", "code", "status", "failed"),
    [
        (WrongRole("x"), worker_pb2.WorkerError.WRONG_ROLE, grpc.StatusCode.UNAVAILABLE, True),
        (NoFreeBlocksError("x"), worker_pb2.WorkerError.NO_FREE_BLOCKS, grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (KvCompatError("x"), worker_pb2.WorkerError.KV_INCOMPATIBLE, grpc.StatusCode.FAILED_PRECONDITION, False),
        (TimeoutError("x"), worker_pb2.WorkerError.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED, False),
        (RuntimeError("x"), worker_pb2.WorkerError.INTERNAL, grpc.StatusCode.INTERNAL, False),
    ],
)
def test_each_exception_is_one_code_at_the_boundary_and_one_status_at_the_router(exc, code, status, failed):
    answer = WorkerBoundary(_Raises(exc)).release(worker_pb2.ReleaseRequest(request_id="r1"))
    assert isinstance(answer, worker_pb2.WorkerError) and answer.code == code
    with pytest.raises(RouterError) as err:
        asyncio.run(_fails(exc).release("r1", 5.0))
    assert err.value.code == status and err.value.worker_failed == failed


def test_an_unexpected_host_error_names_its_type_not_its_host():
    err = to_router_error(_ray_wrapped(RuntimeError("engine loop stopped")), "prefill")
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert err.message == "prefill: RuntimeError: engine loop stopped"


def test_a_very_long_reason_is_cut():
    assert len(short_reason(RuntimeError("x" * 5000))) == 300


@pytest.mark.parametrize(
    ("method", "path", "status", "message", "code"),
    [
        ("GET", "/v1/no-such-route", 404, "Invalid URL (GET /v1/no-such-route)", "not_found"),
        ("POST", "/v2/completions", 404, "Invalid URL (POST /v2/completions)", "not_found"),
        ("GET", "/v1/completions", 405, "Method GET not allowed for /v1/completions", "method_not_allowed"),
    ],
)
def test_unknown_routes_answer_in_the_openai_error_shape(method, path, status, message, code):
    async def go() -> tuple[int, dict]:
        # Unknown routes never reach the router, so none is needed behind the app.
        async with TestClient(TestServer(build_app(None))) as client:  # type: ignore[arg-type]
            resp = await client.request(method, path)
            return resp.status, await resp.json()

    got_status, body = asyncio.run(go())
    assert got_status == status
    # `code` is always set, so that a client can branch on it: the status in words where nothing is more specific.
    assert body == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
