"""Health that tells the truth: whether the router can serve a request now, for gRPC's standard
health service (per service) and HTTP's /health.

The Inference service needs a decode worker in placement: with none, every request would be
refused UNAVAILABLE. The prefill pool is not needed for serving: with no prefill worker in
placement a decode worker prefills its requests itself (`router.placement.decode_strategy`),
so an empty or dead prefill pool costs speed, not service. The Admin service answers from the
router alone and is SERVING while the process runs. The unnamed service ("") is the server as a
whole, which probes (the Helm chart's) check: it follows Inference.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from pdserve.router.router import Router
from pdserve_proto import inference_pb2

INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN = inference_pb2.DESCRIPTOR.services_by_name["Admin"].full_name

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def unserviceable(router: Router) -> str | None:
    """Why the router cannot serve a request now, or None when it can."""
    if not router.decode_policy.workers:
        return "no decode worker in placement"
    return None


class RouterHealth(health.aio.HealthServicer):
    """gRPC health whose statuses are worked out from the router at each Check (and when a Watch
    begins), rather than set once at start-up: a probe always sees the pools as they are."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    async def refresh(self) -> None:
        inference = _SERVING if unserviceable(self.router) is None else _NOT_SERVING
        for name, status in ((INFERENCE, inference), ("", inference), (ADMIN, _SERVING)):
            if self._server_status.get(name) != status:
                await self.set(name, status)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        await self.refresh()
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        await self.refresh()
        return await super().Watch(request, context)
