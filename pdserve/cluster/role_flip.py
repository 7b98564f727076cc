"""The P:D controller's actuator: flip a worker between the pools in place, one flip at a time
(docs/controller.md, "The flip protocol"). Drain (a decode worker's streams still running at the
deadline resume on another decode worker; a prefill worker that does not drain in time goes back
unchanged), switch the role over the same engine, weights, KV pool and prefix cache
(`WorkerHost.switch_role`; the role epoch goes up), link with the new peer pool, probe with one
small request, rejoin the other pool. A flip that fails after the drain leaves the worker out of
placement and listed as unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace

from pdserve.cluster.worker_client import WorkerClient
from pdserve.control.signals import Role
from pdserve.control.widths import flip_refusal
from pdserve.router.deadline import within
from pdserve.router.router import Router
from pdserve_proto import inference_pb2, worker_pb2

log = logging.getLogger(__name__)


class FlipRefused(ValueError):
    """The flip asked for cannot start (unknown worker, same role, last worker of a pool)."""


class FlipInFlight(RuntimeError):
    """Another flip is still draining, switching or probing."""


@dataclass(frozen=True)
class FlipConfig:
    drain_timeout_s: float = 30.0  # then a decode worker's streams move; a prefill worker stays
    switch_timeout_s: float = 60.0
    probe_timeout_s: float = 30.0
    probe_prompt: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    min_prefill: int = 0  # 0: the cluster may become colocated
    min_decode: int = 1
    history: int = 50  # flips kept for Admin.GetController
    # The pools' tensor-parallel widths: a worker keeps its width when it flips, so a flip is
    # made only between pools of one width (a pool counts workers of its own width).
    prefill_width: int = 1
    decode_width: int = 1

    def width_refusal(self) -> str | None:
        """Why no worker may flip between these pools, or None."""
        why = flip_refusal(self.prefill_width, self.decode_width)
        return None if why is None else f"role: {why}"


class FlipHosts(Protocol):
    """What the flipper needs of whatever hosts the workers (Ray actors, or this process)."""

    async def switch(self, worker_id: str, role: str, timeout_s: float) -> worker_pb2.WorkerHealth: ...

    async def link(self, worker_id: str, role: str, timeout_s: float) -> None:
        """Connect the worker's KV transport with every worker of the pool it now serves."""

    def client(self, worker_id: str) -> WorkerClient: ...


class RoleFlipper:
    """Implements `pdserve.control.actuator.Actuator` over a router and its worker hosts."""

    def __init__(
        self,
        router: Router,
        hosts: FlipHosts,
        cfg: FlipConfig = FlipConfig(),
        tracer: trace.Tracer | None = None,
        on_change: Callable[[inference_pb2.RoleChange], None] | None = None,
    ) -> None:
        self.router = router
        self.hosts = hosts
        self.cfg = cfg
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self._on_change = on_change  # metrics, the controller's flip time
        self.changes: list[inference_pb2.RoleChange] = []
        self.unhealthy: set[str] = set()
        self._current: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    # ----- Actuator ----------------------------------------------------------------------------

    def pick(self, donor: Role) -> str | None:
        """The donor pool's worker with the fewest requests (the cheapest to drain), if the pool
        may lose one."""
        pool = self._pool(donor.value)
        if len(pool) <= self._minimum(donor.value) or self.cfg.width_refusal() is not None:
            return None
        busy = self.router.pools.busy
        return min(pool, key=lambda w: (busy(w), w), default=None)

    def flip(self, worker: str, to: Role) -> None:
        if self.in_flight():
            raise FlipInFlight("a role flip is in flight")
        self._current = asyncio.get_running_loop().create_task(self.change(worker, to.value))

    def in_flight(self) -> bool:
        return self._lock.locked() or (self._current is not None and not self._current.done())

    # ----- one flip ------------------------------------------------------------------------------

    async def change(self, worker_id: str, role: str, drain_timeout_s: float | None = None) -> inference_pb2.RoleChange:
        """Flip `worker_id` to `role` and return the record of it (ok or not). Raises
        `FlipRefused` (naming the field) or `FlipInFlight` before anything moved."""
        if role not in ("prefill", "decode"):
            raise FlipRefused(f"role: {role!r} is neither prefill nor decode")
        if self._lock.locked():
            raise FlipInFlight("a role flip is in flight; one at a time")
        async with self._lock:
            source = self._role_of(worker_id)
            if source == role:
                raise FlipRefused(f"role: {worker_id} is already a {role} worker")
            if (refusal := self.cfg.width_refusal()) is not None:
                raise FlipRefused(refusal)
            if len(self._pool(source)) <= self._minimum(source):
                raise FlipRefused(
                    f"worker_id: {worker_id} is the last {source} worker the cluster may keep "
                    f"(at least {self._minimum(source)})"
                )
            drain_s = self.cfg.drain_timeout_s if not drain_timeout_s else drain_timeout_s
            change = inference_pb2.RoleChange(worker_id=worker_id, from_role=source, to_role=role, started_at=time.time())
            with self.tracer.start_as_current_span(
                "pdserve.role_flip", attributes={"pdserve.worker_id": worker_id, "pdserve.from": source, "pdserve.to": role}
            ) as span:
                await self._run(change, drain_s, span)
                span.set_attributes({"pdserve.flip.ok": change.ok, "pdserve.flip.epoch": change.epoch})
            self.changes.append(change)
            del self.changes[: -self.cfg.history]
            if self._on_change is not None:
                self._on_change(change)
            level = logging.INFO if change.ok else logging.WARNING
            log.log(
                level, "role flip %s %s->%s: %s (drain %.2f s, switch %.2f s, probe %.2f s, %d streams moved)",
                worker_id, source, role, "ok" if change.ok else f"failed: {change.error}",
                change.drain_s, change.switch_s, change.probe_s, change.streams_moved,
            )
            return change

    async def _run(self, change: inference_pb2.RoleChange, drain_timeout_s: float, span: trace.Span) -> None:
        worker, source, role = change.worker_id, change.from_role, change.to_role
        old_client = self._pool(source)[worker]
        t = time.monotonic()
        drained, moved = await self.router.take_out(worker, drain_timeout_s)
        change.drain_s, change.streams_moved = time.monotonic() - t, moved
        span.add_event("drained", {"seconds": change.drain_s, "drained": drained, "streams_moved": moved})
        if not drained:
            # Still serving: it goes back to its pool as it was, and the flip is not made.
            await self._rejoin(source, old_client)
            change.error = f"drain: {worker} still served requests after {drain_timeout_s:g} s; left in the {source} pool"
            return
        phase = "switch"
        try:
            t = time.monotonic()
            health = await self.hosts.switch(worker, role, self.cfg.switch_timeout_s)
            await self.hosts.link(worker, role, self.cfg.switch_timeout_s)
            change.switch_s, change.epoch = time.monotonic() - t, health.epoch
            span.add_event("switched", {"seconds": change.switch_s, "epoch": health.epoch})
            phase = "probe"
            t = time.monotonic()
            client = self.hosts.client(worker)
            await within(self._probe(client, role, f"probe-{worker}-{health.epoch}"), self.cfg.probe_timeout_s)
            change.probe_s = time.monotonic() - t
            span.add_event("probed", {"seconds": change.probe_s})
        except Exception as exc:  # noqa: BLE001 -- any failure past the drain: out of placement, shown unhealthy
            change.error = f"{phase}: {type(exc).__name__}: {exc}"
            self.unhealthy.add(worker)
            span.set_status(trace.Status(trace.StatusCode.ERROR, change.error))
            return
        await self._rejoin(role, client)
        self.unhealthy.discard(worker)
        change.ok = True

    async def _probe(self, client: WorkerClient, role: str, rid: str) -> None:
        """One small greedy request in the new role, cleaned up after."""
        ids, timeout = list(self.cfg.probe_prompt), self.cfg.probe_timeout_s
        if role == "prefill":
            params = worker_pb2.WorkerSamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1)
            await client.prefill(worker_pb2.PrefillRequest(prompt_token_ids=ids, params=params, request_id=rid), timeout)
            await client.release(rid, timeout)
            return
        params = worker_pb2.WorkerSamplingParams(max_tokens=2, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True)
        await client.submit(worker_pb2.SubmitRequest(prompt_token_ids=ids, params=params, request_id=rid), timeout)
        while True:  # nobody else polls a worker out of placement: every update is the probe's
            updates = await client.poll(0.2, timeout)
            if any(u.request_id == rid and u.finish_reason for u in updates.updates):
                return

    async def _rejoin(self, role: str, client: Any) -> None:
        if role == "prefill":
            await self.router.add_prefill(client)
        else:
            await self.router.add_decode(client)

    # ----- helpers -------------------------------------------------------------------------------

    def _pool(self, role: str) -> dict[str, Any]:
        return self.router.pools.prefills if role == "prefill" else self.router.pools.decodes

    def _minimum(self, role: str) -> int:
        return self.cfg.min_prefill if role == "prefill" else self.cfg.min_decode

    def _role_of(self, worker_id: str) -> str:
        if worker_id in self.router.pools.prefills:
            return "prefill"
        if worker_id in self.router.pools.decodes:
            return "decode"
        known = ", ".join(sorted((*self.router.pools.prefills, *self.router.pools.decodes)))
        raise FlipRefused(f"worker_id: no worker {worker_id!r} in placement (workers: {known})")
