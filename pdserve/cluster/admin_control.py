"""The cluster's side of the Admin service's control (`router.fleet_control.ControlPlane`):
role flips by hand through the role flipper, the P:D controller's state, with the pools
as placement has them and the flips so far, and each pool's workers as the reconciler keeps it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import grpc
from opentelemetry import trace

from pdserve.cluster.control_loop import ControlLoop, FlipActuator, RouterSignals, Scaler, default_perf_model
from pdserve.cluster.pool_reconciler import PoolReconciler
from pdserve.cluster.serve_config import ControllerSettings
from pdserve.control.capacity import CapacityModel
from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.perf_model import load_perf_model
from pdserve.control.tp_model import PoolWidths, WidthModels
from pdserve.router.fleet_control import NO_FLIPS
from pdserve.router.handles import RouterError
from pdserve.router.router import Router
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2


class Flipper(FlipActuator, Protocol):
    """What `set_role` needs of the role flipper besides the Actuator."""

    unhealthy: set[str]

    async def change(self, worker_id: str, role: str, drain_timeout_s: float | None) -> inference_pb2.RoleChange: ...


def build_control_loop(
    settings: ControllerSettings,
    router: Router,
    flipper: FlipActuator | None,
    workers: int,
    device: str,
    metrics: RouterMetrics,
    tracer: trace.Tracer | None = None,
    scaler: Scaler | None = None,
    widths: Mapping[str, int] | None = None,
) -> ControlLoop:
    """The loop `pdserve serve --controller` runs: the budget is `workers` (those started), the
    prior the named performance model (or the device's default), fitted online; with a scaler,
    workers may be added up to `settings.max_workers`. widths: each pool's tensor-parallel width
    (default 1): the prior is the named model's at those widths (`tp_model`), and with different
    widths no worker flips."""
    w = widths or {}
    base = load_perf_model(settings.perf_model or default_perf_model(device))
    model = PoolWidths(WidthModels(base), prefill=w.get("prefill", 1), decode=w.get("decode", 1)).pair()
    cfg = ControllerConfig(
        workers=workers, slo=settings.slo, min_interval_s=settings.min_interval_s,
        min_prefill=0 if settings.colocated else 1,
        max_workers=settings.max_workers if scaler is not None else None,
        prefill_width=w.get("prefill", 1), decode_width=w.get("decode", 1),
    )  # fmt: skip
    return ControlLoop(
        Controller(cfg, flip_s=model.flip_s, start_s=model.start_s),
        CapacityModel(model),
        flipper,
        RouterSignals(router, router.config.control_timeout_s),
        metrics,
        tracer,
        window_s=settings.window_s,
        scaler=scaler,
    )


class ClusterControl:
    """`flipper` None: no role flips here (SetRole answers FAILED_PRECONDITION); `loop` None:
    no --controller (GetController says enabled=false, pools and flips still shown)."""

    def __init__(self, router: Router, flipper: Flipper | None = None, loop: ControlLoop | None = None) -> None:
        self.router = router
        self.flipper = flipper
        self.loop = loop
        self.reconciler: PoolReconciler | None = None  # the cluster's, once it runs (`Cluster.attach_control`)

    def pools(self) -> list[inference_pb2.PoolWorkers]:
        """Each pool's workers as the reconciler keeps it (none where no reconciler runs)."""
        return [] if self.reconciler is None else self.reconciler.pools_pb()

    async def set_role(self, worker_id: str, role: str, drain_timeout_s: float | None) -> inference_pb2.RoleChange:
        flipper = self.flipper
        if flipper is None:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, f"{NO_FLIPS}: the cluster has no role flipper")
        pools = self.router.pools
        if worker_id not in pools.prefills and worker_id not in pools.decodes:
            known = ", ".join(sorted((*pools.prefills, *pools.decodes)))
            raise RouterError(
                grpc.StatusCode.INVALID_ARGUMENT, f"worker_id: no worker {worker_id!r} in placement (workers: {known})"
            )
        if flipper.in_flight():
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, "a role flip is in flight; one at a time")
        try:
            return await flipper.change(worker_id, role, drain_timeout_s)
        except ValueError as exc:  # the flipper refused the request itself; its message names the field
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        except RuntimeError as exc:  # another flip started in between
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc

    def controller_state(self) -> inference_pb2.ControllerState:
        st = inference_pb2.ControllerState() if self.loop is None else self.loop.state()
        st.prefill = len(self.router.prefill_policy.workers)
        st.decode = len(self.router.decode_policy.workers)
        if self.flipper is not None:
            st.changes.extend(self.flipper.changes)
            st.unhealthy.extend(sorted(self.flipper.unhealthy))
        return st

    def start(self) -> None:
        if self.reconciler is not None:
            self.reconciler.start()
        if self.loop is not None:
            self.loop.start()

    async def stop(self) -> None:
        if self.loop is not None:
            await self.loop.stop()
        if self.reconciler is not None:
            await self.reconciler.stop()
