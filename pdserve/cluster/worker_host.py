"""One worker of either role, and its in-place role flip.

The host owns what outlives a role: the engine (weights, KV pool, prefix cache) and the KV
transport registered over that pool. The role's own structures (a `PrefillWorker` with its
leases, or a `DecodeWorker` with its token outbox) sit on top and are rebuilt by
`switch_role`. Every role flip adds one to `epoch`: a call placed for the old role (a late
placement) finds the other role and fails with `WrongRole` (the code WRONG_ROLE), which the
router takes as "this worker left the pool" and places elsewhere. Ray hosts it in
`pdserve.cluster.actors.WorkerActor`; tests host it in-process.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import trace

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.transport import KvTransport
from pdserve.telemetry.context import TraceCarrier
from pdserve_proto import inference_pb2, kv_pb2, worker_pb2

if TYPE_CHECKING:
    from pdserve.decode_worker.decoder import DecodeConfig, DecodeWorker
    from pdserve.engine.engine import LLMEngine
    from pdserve.prefill_worker.prefiller import PrefillConfig, PrefillWorker

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]


class WrongRole(RuntimeError):
    """A call for the role this worker had before a flip (or never had)."""


class WorkerHost:
    """Forwards each call to the worker of its current role, with the roles' own signatures
    (engine types); `pdserve.cluster.worker_boundary.WorkerBoundary` serves worker.proto's
    calls over it."""

    def __init__(
        self,
        worker: PrefillWorker | DecodeWorker,
        role: Role,
        prefill_config: PrefillConfig,
        decode_config: DecodeConfig,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.role: Role = role
        self.prefill_config = prefill_config  # each role's settings, for when the worker flips to it
        self.decode_config = decode_config
        self.worker = worker
        self.epoch = 0
        self._tracer = tracer
        self._switching = False

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    @property
    def engine(self) -> LLMEngine:
        return self.worker.engine

    @property
    def agent(self) -> KvTransport:
        return self.worker.agent

    # ----- role flip -----------------------------------------------------------------------

    def switch_role(self, role: Role, idle_timeout_s: float = 10.0) -> worker_pb2.WorkerHealth:
        """Become a `role` worker, keeping the engine and its KV transport. The router has
        drained this worker; what it still holds (a prefill's KV whose pull notice is on its
        way, an aborted stream's last step) must clear within `idle_timeout_s`, else
        RuntimeError and the worker keeps its role. Returns the health in the new role."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: {role!r} is neither prefill nor decode")
        if role == self.role:
            return self.health()
        old = self.worker
        self._switching = True  # from now on a call of either role is refused (WrongRole)
        try:
            self._switch(old, role, idle_timeout_s)
        finally:
            self._switching = False
        log.info("worker %s is now a %s worker (epoch %d)", self.worker_id, role, self.epoch)
        return self.health()

    def _switch(self, old: PrefillWorker | DecodeWorker, role: Role, idle_timeout_s: float) -> None:
        from pdserve.decode_worker.decoder import DecodeWorker
        from pdserve.prefill_worker.prefiller import PrefillWorker

        deadline = time.monotonic() + idle_timeout_s
        while True:
            with old.loop.lock:
                held = self.engine.holds_requests()
                if not held:
                    # Stopped under its lock: no step of the old role runs after the check.
                    old.loop.request_stop()
                    break
            if time.monotonic() >= deadline:
                raise RuntimeError(f"switch_role: {self.worker_id} still holds {held} requests after {idle_timeout_s:g} s")
            time.sleep(0.02)
        old.close()
        engine, agent = self.engine, self.agent
        engine.switch_role(role)
        if role == "prefill":
            self.worker = PrefillWorker(self.worker_id, engine, agent, self.prefill_config, tracer=self._tracer)
        else:
            self.worker = DecodeWorker(self.worker_id, engine, agent, self.decode_config, self._tracer)
        self.role = role
        self.epoch += 1

    # ----- cluster set-up ------------------------------------------------------------------

    def agent_info(self) -> kv_pb2.KvAgentInfo:
        return self.agent.info()

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        if not self.agent.is_connected(info.agent_name):
            self.agent.connect(info)

    # ----- prefill -------------------------------------------------------------------------

    def prefill(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
        progress_to: str = "",
    ) -> worker_pb2.PrefillResult:
        return self._prefill().prefill(ids, params, rid, timeout_s, trace_context, progress_to)

    def release(self, rid: str) -> bool:
        return self._prefill().release(rid)

    # ----- decode -------------------------------------------------------------------------
    # Arguments after the first ones pass through as they are (the decode worker's signature).

    def start(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        prefilled: worker_pb2.PrefillResult,
        *rest: Any,
    ) -> worker_pb2.DecodeStart:
        return self._decode().start(ids, params, rid, prefilled, *rest)

    def prefetch(self, ids: list[int], params: SamplingParams, rid: str, *rest: Any) -> worker_pb2.DecodePrefetch:
        return self._decode().prefetch(ids, params, rid, *rest)

    def submit(self, ids: list[int], params: SamplingParams, rid: str, *rest: Any) -> worker_pb2.DecodeSubmit:
        return self._decode().submit(ids, params, rid, *rest)

    def abort(self, rid: str, *rest: Any) -> bool:
        return self._decode().abort(rid, *rest)

    def poll(self, wait_s: float, *rest: Any) -> worker_pb2.TokenUpdates:
        return self._decode().poll(wait_s, *rest)

    # ----- both ----------------------------------------------------------------------------

    def health(self) -> worker_pb2.WorkerHealth:
        health = self.worker.health()
        health.epoch = self.epoch
        return health

    def stats(self) -> inference_pb2.WorkerStats:
        return self.worker.stats()

    def kv_events(self, wait_s: float, full: bool, router_id: str = "") -> worker_pb2.KvEventBatch:
        return self.worker.kv_events(wait_s, full, router_id)

    def close(self) -> None:
        self.worker.close()

    def _prefill(self) -> PrefillWorker:
        from pdserve.prefill_worker.prefiller import PrefillWorker

        worker = self.worker
        if self._switching or not isinstance(worker, PrefillWorker):
            raise WrongRole(f"role: {self.worker_id} is a {self.role} worker (epoch {self.epoch}), not a prefill worker")
        return worker

    def _decode(self) -> DecodeWorker:
        from pdserve.decode_worker.decoder import DecodeWorker

        worker = self.worker
        if self._switching or not isinstance(worker, DecodeWorker):
            raise WrongRole(f"role: {self.worker_id} is a {self.role} worker (epoch {self.epoch}), not a decode worker")
        return worker
