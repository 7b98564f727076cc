"""worker.proto's `service Worker` is the contract: every rpc has one typed method, taking its
request message, on each side (the worker's boundary, both transports, the transport
Protocol), and every `WorkerError` code has one status at the router."""

from __future__ import annotations

import inspect
import re

import grpc
import pytest

from pdserve.cluster.actors import RayWorker
from pdserve.cluster.worker_boundary import WorkerBoundary
from pdserve.cluster.worker_client import LocalWorker, WorkerTransport
from pdserve.router.errors import from_worker_error
from pdserve_proto import worker_pb2

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"]


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_the_service_declares_every_call_the_router_makes():
    assert set(SERVICE.methods_by_name) == {
        "Prefill", "Release", "Start", "Prefetch", "Submit", "Abort", "Poll", "Health", "Stats", "KvEvents",
    }


@pytest.mark.parametrize("side", [WorkerBoundary, RayWorker, LocalWorker, WorkerTransport])
@pytest.mark.parametrize("rpc", list(SERVICE.methods_by_name))
def test_each_side_has_one_method_per_rpc_taking_its_request_message(side, rpc):
    method = getattr(side, snake(rpc), None)
    assert method is not None, f"{side.__name__} has no {snake(rpc)} for rpc {rpc}"
    # After self. Ray's tracing adds `_ray_trace_ctx` to the methods of a class made an actor
    # (WorkerActor builds on the boundary) once a test in this process has started one.
    params = [p for p in list(inspect.signature(method).parameters.values())[1:] if p.name != "_ray_trace_ctx"]
    assert len(params) == 1, f"{side.__name__}.{snake(rpc)} takes {[p.name for p in params]}"
    assert SERVICE.methods_by_name[rpc].input_type.name in str(params[0].annotation)


def test_the_boundary_answers_a_worker_error_in_place_of_the_result():
    class Gone:
        worker_id = "w"

        def stats(self) -> object:
            raise RuntimeError("stats broke")

    answer = WorkerBoundary(Gone()).stats(worker_pb2.StatsRequest())
    assert answer == worker_pb2.WorkerError(code=worker_pb2.WorkerError.INTERNAL, message="RuntimeError: stats broke")


@pytest.mark.parametrize(
    ("code", "status", "worker_failed"),
    [
        ("WRONG_ROLE", grpc.StatusCode.UNAVAILABLE, True),
        ("ENGINE_STOPPED", grpc.StatusCode.UNAVAILABLE, True),
        ("NO_FREE_BLOCKS", grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        ("KV_INCOMPATIBLE", grpc.StatusCode.FAILED_PRECONDITION, False),
        ("REQUEST_ENDED", grpc.StatusCode.UNAVAILABLE, False),
        ("DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED, False),
        ("INVALID_REQUEST", grpc.StatusCode.INVALID_ARGUMENT, False),
        ("INTERNAL", grpc.StatusCode.INTERNAL, False),
        ("UNSPECIFIED", grpc.StatusCode.INTERNAL, False),  # a code this router does not know: the server's fault
    ],
)
def test_each_code_is_one_status_at_the_router(code, status, worker_failed):
    err = from_worker_error(worker_pb2.WorkerError(code=worker_pb2.WorkerError.Code.Value(code), message="why"), "call")
    assert (err.code, err.worker_failed) == (status, worker_failed)


def test_every_code_is_tested():
    tested = {"WRONG_ROLE", "ENGINE_STOPPED", "NO_FREE_BLOCKS", "KV_INCOMPATIBLE", "REQUEST_ENDED",
              "DEADLINE_EXCEEDED", "INVALID_REQUEST", "INTERNAL", "UNSPECIFIED"}
    assert set(worker_pb2.WorkerError.Code.keys()) == tested
