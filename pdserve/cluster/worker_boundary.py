"""The worker's side of worker.proto's `service Worker`: one method per call, taking its request
message and answering the result message, or a `WorkerError` in place of it.

This is the one place a worker's exceptions become error codes; the router reads only the codes
(`router.errors.from_worker_error`). The role classes keep their Python signatures (engine
types); messages are converted here, on the way in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.cluster.worker_client import LocalWorker
from pdserve.cluster.worker_host import WrongRole
from pdserve.decode_worker.early_aborts import RequestAborted
from pdserve.engine.block_manager import NoFreeBlocksError
from pdserve.engine.loop import EngineStopped
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.compat import KvCompatError
from pdserve.prefill_worker.prefiller import PrefillCancelled
from pdserve.router.edge.grammar_fields import structured_output_of
from pdserve.telemetry.context import TraceCarrier
from pdserve_proto import inference_pb2, worker_pb2

log = logging.getLogger(__name__)

Code = worker_pb2.WorkerError.Code
_T = TypeVar("_T")
MAX_MESSAGE_CHARS = 300


class InvalidRequest(ValueError):
    """The request's own content is wrong (the client's fault, INVALID_REQUEST); a ValueError
    of any other kind inside a worker is the server's (INTERNAL)."""


# Checked in order: KvCompatError is a ValueError, so it comes before any ValueError.
_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (WrongRole, Code.WRONG_ROLE),
    (EngineStopped, Code.ENGINE_STOPPED),
    (NoFreeBlocksError, Code.NO_FREE_BLOCKS),
    (KvCompatError, Code.KV_INCOMPATIBLE),
    (RequestAborted, Code.REQUEST_ENDED),
    (PrefillCancelled, Code.REQUEST_ENDED),
    (TimeoutError, Code.DEADLINE_EXCEEDED),
    (InvalidRequest, Code.INVALID_REQUEST),
)


def error_of(exc: BaseException) -> worker_pb2.WorkerError:
    """The code and one-line reason a worker answers for `exc`."""
    lines = str(exc).strip().splitlines()
    reason = lines[0].strip() if lines else ""
    code = next((c for cls, c in _CODES if isinstance(exc, cls)), Code.INTERNAL)
    if code == Code.INTERNAL:
        log.error("worker call failed", exc_info=exc)  # a fault of ours: the traceback stays here
        reason = f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__
    if len(reason) > MAX_MESSAGE_CHARS:
        reason = reason[: MAX_MESSAGE_CHARS - 3] + "..."
    return worker_pb2.WorkerError(code=code, message=reason)


def sampling_params_of(msg: worker_pb2.WorkerSamplingParams) -> SamplingParams:
    """The engine's params for `msg`; InvalidRequest if they are not valid."""
    try:
        return SamplingParams(
            max_tokens=msg.max_tokens,
            temperature=msg.temperature,
            top_p=msg.top_p,
            top_k=msg.top_k,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            logprobs=msg.logprobs,
            top_logprobs=msg.top_logprobs,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            logit_bias=dict(msg.logit_bias),
            min_tokens=msg.min_tokens,
            output_offset=msg.output_offset,
            structured_output=structured_output_of(msg.structured_output) if msg.HasField("structured_output") else None,
        )
    except ValueError as exc:
        raise InvalidRequest(f"params.{exc}") from None


def _carrier(trace_context: Any) -> TraceCarrier | None:
    return dict(trace_context) if trace_context else None


def _request(ids: Any, request_id: str) -> list[int]:
    if not request_id:
        raise InvalidRequest("request_id: required")
    return list(ids)


# A long poll waits at most this long: a router polls every few ms to a second.
MAX_WAIT_S = 60.0


def _wait_s(wait_s: float) -> float:
    """A poll's wait, checked: NaN or infinity would make the wait spin or never end."""
    if not math.isfinite(wait_s) or not 0.0 <= wait_s <= MAX_WAIT_S:
        raise InvalidRequest(f"wait_s: {wait_s}; must be finite, within [0, {MAX_WAIT_S:g}]")
    return wait_s


# Router ids never hold it, so a key splits back into exactly one (router id, request id).
KEY_SEP = "/"


def request_key(router_id: str, request_id: str) -> str:
    """The worker's own id for `request_id` of `router_id`: requests of different routers never
    share one, so a client's id can neither reach nor abort another router's request."""
    if KEY_SEP in router_id:
        raise InvalidRequest(f"router_id: {router_id!r} may not contain {KEY_SEP!r}")
    return f"{router_id}{KEY_SEP}{request_id}"


def _client_ids(updates: worker_pb2.TokenUpdates, router_id: str) -> worker_pb2.TokenUpdates:
    """`updates` of `router_id` with the request ids its router gave (the worker's keys stripped)."""
    prefix = router_id + KEY_SEP
    for u in updates.updates:
        u.request_id = u.request_id.removeprefix(prefix)
    return updates


class WorkerBoundary:
    """`service Worker` over `target`: a `WorkerHost` (either role, flips included) or one role
    worker itself (in-process tests). Every call answers its result or a `WorkerError`."""

    def __init__(self, target: Any) -> None:
        self.target = target

    @property
    def worker_id(self) -> str:
        return self.target.worker_id

    def _answer(self, call: Callable[[], _T]) -> _T | worker_pb2.WorkerError:
        try:
            return call()
        except Exception as exc:
            return error_of(exc)

    # ----- prefill -------------------------------------------------------------------------

    def prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResult | worker_pb2.WorkerError:
        def call() -> worker_pb2.PrefillResult:
            ids = _request(request.prompt_token_ids, request.request_id)
            return self.target.prefill(
                ids, sampling_params_of(request.params), request_key(request.router_id, request.request_id),
                request.timeout_s,
                _carrier(request.trace_context), request.progress_to,
            )

        return self._answer(call)

    def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.Freed | worker_pb2.WorkerError:
        return self._answer(
            lambda: worker_pb2.Freed(held=bool(self.target.release(request_key(request.router_id, request.request_id))))
        )

    # ----- decode --------------------------------------------------------------------------

    def start(self, request: worker_pb2.StartRequest) -> worker_pb2.DecodeStart | worker_pb2.WorkerError:
        def call() -> worker_pb2.DecodeStart:
            ids = _request(request.prompt_token_ids, request.request_id)
            return self.target.start(
                ids, sampling_params_of(request.params), request_key(request.router_id, request.request_id),
                request.prefilled,
                _carrier(request.trace_context), request.router_id,
            )

        return self._answer(call)

    def prefetch(self, request: worker_pb2.PrefetchRequest) -> worker_pb2.DecodePrefetch | worker_pb2.WorkerError:
        def call() -> worker_pb2.DecodePrefetch:
            ids = _request(request.prompt_token_ids, request.request_id)
            key = request_key(request.router_id, request.request_id)
            return self.target.prefetch(ids, sampling_params_of(request.params), key, request.router_id)

        return self._answer(call)

    def submit(self, request: worker_pb2.SubmitRequest) -> worker_pb2.DecodeSubmit | worker_pb2.WorkerError:
        def call() -> worker_pb2.DecodeSubmit:
            ids = _request(request.prompt_token_ids, request.request_id)
            return self.target.submit(
                ids, sampling_params_of(request.params), request_key(request.router_id, request.request_id),
                _carrier(request.trace_context), request.router_id,
            )

        return self._answer(call)

    def abort(self, request: worker_pb2.AbortRequest) -> worker_pb2.Freed | worker_pb2.WorkerError:
        return self._answer(
            lambda: worker_pb2.Freed(held=bool(self.target.abort(request_key(request.router_id, request.request_id))))
        )

    def poll(self, request: worker_pb2.PollRequest) -> worker_pb2.TokenUpdates | worker_pb2.WorkerError:
        acked = request.acked if request.HasField("acked") else None
        return self._answer(
            lambda: _client_ids(self.target.poll(_wait_s(request.wait_s), request.router_id, acked), request.router_id)
        )

    # ----- both ----------------------------------------------------------------------------

    def health(self, request: worker_pb2.HealthRequest | None = None) -> worker_pb2.WorkerHealth | worker_pb2.WorkerError:
        return self._answer(self.target.health)

    def stats(self, request: worker_pb2.StatsRequest | None = None) -> inference_pb2.WorkerStats | worker_pb2.WorkerError:
        return self._answer(self.target.stats)

    def kv_events(self, request: worker_pb2.KvEventsRequest) -> worker_pb2.KvEventBatch | worker_pb2.WorkerError:
        return self._answer(lambda: self.target.kv_events(_wait_s(request.wait_s), request.full, request.router_id))


def local_worker(target: Any) -> LocalWorker:
    """The transport a `WorkerClient` uses for `target` (a `WorkerHost` or a role worker) in
    this process."""
    return LocalWorker(WorkerBoundary(target))
