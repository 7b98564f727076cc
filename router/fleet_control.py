"""The Admin service's control of the pools: role flips by hand (`Admin.SetRole`) and the P:D
controller's state (`Admin.GetController`). The router serves them through this Protocol; the
cluster implements it (pdserve.cluster.control_loop), so the router imports neither the flip
nor the controller.

`set_role` reports a request it cannot take as a `RouterError`: INVALID_ARGUMENT naming the
field (an unknown worker, a role it already has, the last worker of a pool), FAILED_PRECONDITION
when a flip is already in flight or the server cannot flip at all."""

from __future__ import annotations

from typing import Protocol

from pdserve.router.placement.pool_state import DecodePolicy, PrefillPolicy
from pdserve_proto import inference_pb2

ROLES = ("prefill", "decode")
NO_FLIPS = "no role flips in this server"


class ControlPlane(Protocol):
    """What the Admin service needs of the cluster: a role flip by hand, the P:D controller's state and the pools."""
    async def set_role(self, worker_id: str, role: str, drain_timeout_s: float | None) -> inference_pb2.RoleChange: ...

    def controller_state(self) -> inference_pb2.ControllerState: ...

    def pools(self) -> list[inference_pb2.PoolWorkers]:
        """Each pool's workers as the cluster's reconciler keeps it (`Admin.GetStats`)."""
        ...


def pools_state(prefill: PrefillPolicy, decode: DecodePolicy) -> inference_pb2.ControllerState:
    """A server without a control plane: no controller, the pools as placement has them."""
    return inference_pb2.ControllerState(enabled=False, prefill=len(prefill.workers), decode=len(decode.workers))
