"""The public gRPC server: Inference and Admin services, standard health checks and reflection."""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.router.edge.auth import ApiKeys
from pdserve.router.edge.grpc_auth import EdgeInterceptor
from pdserve.router.edge.health import ADMIN, INFERENCE, RouterHealth
from pdserve.router.edge.limits import InputLimits, check_request
from pdserve.router.edge.tls import CertificateFiles, grpc_credentials
from pdserve.router.edge.unknown_fields import unknown_fields, unknown_fields_message
from pdserve.router.fleet_control import NO_FLIPS, ROLES, ControlPlane, pools_state
from pdserve.router.handles import RouterError
from pdserve.router.router import Router
from pdserve_proto import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

RETRY_AFTER_MS = "retry-after-ms"  # trailing metadata of a refusal under overload: when to retry
RETRY_AFTER = "retry-after"  # the same in whole seconds, rounded up, as HTTP's Retry-After

SERVICE_NAMES = (INFERENCE, ADMIN)


async def refuse_unknown_fields(request: Message, context: grpc.aio.ServicerContext, allow: bool) -> None:
    """Abort with INVALID_ARGUMENT naming the field numbers of `request` that this server does not
    know (they would be dropped in silence), unless `allow` (`--allow-unknown-fields`)."""
    names = [] if allow else unknown_fields(request)
    if names:
        log.info("refused a %s with unknown fields %s", type(request).__name__, names)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, unknown_fields_message(names))


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """The Inference service: checks each request against the input limits, streams its generation
    from the router with a `RouterError` turned into its gRPC status, and lists the model. A request
    with fields it does not know is refused unless `allow_unknown_fields`."""
    def __init__(self, router: Router, limits: InputLimits = InputLimits(), allow_unknown_fields: bool = False) -> None:
        self.router = router
        self.limits = limits
        self.allow_unknown_fields = allow_unknown_fields

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        # A client's W3C trace context (gRPC metadata keys are lower-case) parents the request's trace.
        carrier = {k: v for k, v in context.invocation_metadata() or () if k in ("traceparent", "tracestate")}
        await refuse_unknown_fields(request, context, self.allow_unknown_fields)
        try:
            check_request(request, self.limits)
            # The client's deadline (None without one): admission refuses what could not meet it.
            async for chunk in self.router.generate(request, carrier or None, time_left_s=context.time_remaining()):
                yield chunk
        except RouterError as exc:
            log.info("request %s failed: %s %s", request.request_id or "-", exc.code.name, exc.message)
            if exc.retry_after_ms is not None:
                seconds = max(1, math.ceil(exc.retry_after_ms / 1000))
                context.set_trailing_metadata(((RETRY_AFTER_MS, str(exc.retry_after_ms)), (RETRY_AFTER, str(seconds))))
            await context.abort(exc.code, exc.message)
        except (ValueError, UnicodeError) as exc:
            # Validation that raised before it could name a status: still the request's fault.
            log.info("request %s refused: %s", request.request_id or "-", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        await refuse_unknown_fields(request, context, self.allow_unknown_fields)
        return inference_pb2.ListModelsResponse(models=[self.router.model_info()])


class AdminServicer(inference_pb2_grpc.AdminServicer):
    """The Admin service: the cluster's stats, role flips by hand and the P:D controller's state,
    the last two through a `ControlPlane` when this server has one. A request with fields it does
    not know is refused unless `allow_unknown_fields`."""
    def __init__(self, router: Router, control: ControlPlane | None = None, allow_unknown_fields: bool = False) -> None:
        self.router = router
        self.control = control  # role flips and the P:D controller (None: this server has neither)
        self.allow_unknown_fields = allow_unknown_fields

    async def GetStats(
        self, request: inference_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ClusterStats:
        await refuse_unknown_fields(request, context, self.allow_unknown_fields)
        stats = await self.router.cluster_stats()
        if self.control is not None:
            stats.pools.extend(self.control.pools())
        return stats

    async def SetRole(
        self, request: inference_pb2.SetRoleRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SetRoleResponse:
        await refuse_unknown_fields(request, context, self.allow_unknown_fields)
        if request.role not in ROLES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role: {request.role!r} is neither prefill nor decode")
        if not request.worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id: required")
        if request.drain_timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s: must be >= 0 (0: the default)")
        if self.control is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_FLIPS)
        assert self.control is not None
        try:
            change = await self.control.set_role(request.worker_id, request.role, request.drain_timeout_s or None)
        except RouterError as exc:
            log.info("SetRole %s -> %s refused: %s %s", request.worker_id, request.role, exc.code.name, exc.message)
            await context.abort(exc.code, exc.message)
        return inference_pb2.SetRoleResponse(change=change)

    async def GetController(
        self, request: inference_pb2.GetControllerRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ControllerState:
        await refuse_unknown_fields(request, context, self.allow_unknown_fields)
        if self.control is None:
            return pools_state(self.router.prefill_policy, self.router.decode_policy)
        return self.control.controller_state()


async def start_grpc_server(
    router: Router,
    host: str,
    port: int,
    keys: ApiKeys = ApiKeys(),
    tls: CertificateFiles | None = None,
    limits: InputLimits = InputLimits(),
    control: ControlPlane | None = None,
    reuse_port: bool = False,
    allow_unknown_fields: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (port 0 picks a free one). With
    `keys`, calls need an API key (health checks excepted); with `tls`, the port speaks only TLS;
    `control` serves Admin.SetRole and Admin.GetController (None: no flips, no controller);
    `allow_unknown_fields`: ignore request fields the messages do not define (else INVALID_ARGUMENT)."""
    options = [
        # gRPC sets SO_REUSEPORT by default: a second server on the same port would bind too and
        # take half of the new connections. Off, a taken port is an error; on only where asked
        # (router processes sharing the port on purpose, `pdserve serve --routers N`).
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_receive_message_length", limits.max_request_bytes),
    ]
    server = grpc.aio.server(options=options, interceptors=[EdgeInterceptor(keys)])
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(router, limits, allow_unknown_fields), server)
    inference_pb2_grpc.add_AdminServicer_to_server(AdminServicer(router, control, allow_unknown_fields), server)
    health_servicer = RouterHealth(router)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        address = f"{host}:{port}"
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, grpc_credentials(tls))
    except RuntimeError as exc:  # grpcio raises this when the bind fails
        raise OSError(errno.EADDRINUSE, f"gRPC: cannot listen on {host}:{port} (in use?)") from exc
    if bound == 0:
        raise OSError(errno.EADDRINUSE, f"gRPC: cannot listen on {host}:{port} (in use?)")
    await server.start()  # health statuses are worked out at each check (`RouterHealth`)
    return server, bound
