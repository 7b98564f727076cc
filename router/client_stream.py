"""The common tail of both serving paths: a request's tokens from its decode worker's relay,
turned into the client's chunks until it finishes. Text is produced here, at the edge, from
the whole token stream (a prefill worker's first token included), so chunks never split a UTF-8
character and stop strings see all of the text."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from prometheus_client import Histogram

from pdserve.router.failover import Failover
from pdserve.router.handles import RouterError
from pdserve.router.inflight import InFlight
from pdserve.router.router_config import RouterConfig
from pdserve.router.token_stream import WorkerLost
from pdserve_proto import inference_pb2, worker_pb2

log = logging.getLogger(__name__)


class ClientStream:
    """Relays one request's tokens as chunks: coalesces what is queued, cuts at stop strings,
    moves the request when its decode worker is lost, and marks it finished at its end."""

    def __init__(self, config: RouterConfig, tracer: trace.Tracer, failover: Failover) -> None:
        self.config = config
        self.tracer = tracer
        self.failover = failover

    async def relay(
        self, r: InFlight, since: float, first_wait: Histogram
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The decode worker's tokens of `r`, as chunks, until it finishes. `first_wait`
        observes the time from `since` to the first of them."""
        first = self.tracer.start_span("pdserve.decode.first_token", context=r.ctx,
                                       attributes={"pdserve.worker_id": r.d_at.worker})
        r.open_spans.append(first)
        stream_span: trace.Span | None = None
        pending: tuple[list[int], str] | RouterError | None = None  # read while coalescing; handled next
        while True:
            if pending is not None:
                item, pending = pending, None
            else:
                item = await r.stream.next(self.config.token_timeout_s)
                if item is None:  # silent for token_timeout_s
                    item = await self._silent(r)
                    if item is None:
                        continue
            if isinstance(item, WorkerLost):
                if item.worker == r.d_at.worker:  # else: about a worker this request already left
                    await self.failover.resume(r, item)
                continue
            if isinstance(item, RouterError):
                raise item
            tokens, reason = item[0], item[1]
            take_logprobs(r, item)
            if stream_span is None:
                r.dequeue("decode", served=True)
                first.end()
                first_wait.observe(time.monotonic() - since)
                stream_span = self.tracer.start_span("pdserve.stream", context=r.ctx,
                                                     attributes={"pdserve.worker_id": r.d_at.worker})
                r.open_spans.append(stream_span)
            tokens, reason, stopped, pending = self._take_queued(r, tokens, reason)
            if stopped:
                await r.decode.abort(r.rid, self.config.control_timeout_s)
            if reason:
                r.finished()
                stream_span.set_attributes({"pdserve.completion_tokens": r.completion, "pdserve.finish_reason": reason})
                stream_span.end()
            yield chunk(r, tokens, reason)
            if reason:
                return

    @staticmethod
    def _take_queued(
        r: InFlight, tokens: list[int], reason: str
    ) -> tuple[list[int], str, bool, tuple[list[int], str] | RouterError | None]:
        """`tokens` and the updates queued behind them, for one chunk: a poll that carries
        several engine steps, or a client that reads slower than they come, costs one chunk
        (one SSE event) instead of one per step. Each update goes through the detokenizer as it
        came, so the text and where a stop string cuts it are what they would be chunk by chunk.
        Stops at a finish, a stop string, or an item that is not tokens (returned, to be
        handled next). Returns (tokens, finish reason, stopped by a stop string, that item)."""
        out = list(tokens)
        queue = r.stream.queue
        stopped = False
        while True:
            r.completion += len(tokens)
            if r.detok.add(tokens) is not None:
                reason, stopped = "stop", True
            if reason or queue.empty():
                return out, reason, stopped, None
            item = queue.get_nowait()
            if not isinstance(item, tuple):
                return out, reason, stopped, item
            tokens, reason = item[0], item[1]
            take_logprobs(r, item)
            out += tokens

    async def _silent(self, r: InFlight) -> WorkerLost | None:
        """No token of `r` for `token_timeout_s`: a `WorkerLost` if its decode worker fails its
        health check (the stream resumes elsewhere), else None: the worker is alive and the
        request only waits its turn there, as long as its caller's own deadline allows."""
        worker = r.d_at.worker
        try:
            await r.decode.health(self.config.control_timeout_s)
        except RouterError as exc:
            if exc.worker_failed:
                return WorkerLost(worker, f"decode worker {worker} sent nothing for {self.config.token_timeout_s}s "
                                          f"and failed its health check ({exc.message})")
        log.info("request %s: no token from %s for %ss; the worker is alive, waiting on", r.rid, worker,
                 self.config.token_timeout_s)
        return None


def take_first_token(r: InFlight, handle: worker_pb2.PrefillResult) -> None:
    """Count the prefill worker's first token; its logprobs and the prompt's, where asked, came
    back with it (a worker that returned no prompt_logprobs asked for is refused, `unscored`)."""
    r.completion = 1
    if handle.HasField("prompt_logprobs"):
        r.prompt_logprobs = handle.prompt_logprobs
    elif r.params.prompt_logprobs is not None:
        raise unscored(handle.handle.worker_id or (r.p_at.worker if r.p_at else "?"), "prefill")
    if handle.HasField("first_logprob"):
        r.logprobs.append(handle.first_logprob)
        if r.params.top_logprobs:
            r.top_logprobs.append(handle.first_top_logprobs)


def take_logprobs(r: InFlight, item: tuple) -> None:
    """Keep the logprobs that came with a relayed item (tokens, reason[, logprobs, top[,
    prompt logprobs]]) until its tokens go out in a chunk."""
    if len(item) > 2:
        r.logprobs += item[2]
        r.top_logprobs += item[3]
    if len(item) > 4 and not r.generated:  # a stream resumed elsewhere sent them already
        r.prompt_logprobs = item[4]
    elif item[0] and not r.generated and r.prompt_logprobs is None and r.params.prompt_logprobs is not None:
        # Its first tokens came unscored (tokens queued behind scored ones are coalesced into
        # the first chunk before `generated` counts them: those are fine).
        raise unscored(r.d_at.worker, "decode")


def unscored(worker: str, role: str) -> RouterError:
    """A worker that prefilled a prompt asked for its prompt_logprobs and sent none: one of an
    older version (a rolling upgrade; the field is additive, so it ignored it). The request
    fails naming the field rather than answer without them."""
    return RouterError(grpc.StatusCode.UNIMPLEMENTED,
                       f"prompt_logprobs: {role} worker {worker} prefilled the prompt without scoring it "
                       "(it runs a version that does not serve prompt_logprobs); retry once every worker "
                       "is upgraded, or leave prompt_logprobs out")


def chunk(r: InFlight, tokens: list[int], reason: str) -> inference_pb2.GenerateResponse:
    """One chunk for the client: `tokens`, the text they complete, and at the end the usage."""
    r.generated += tokens
    resp = inference_pb2.GenerateResponse(
        request_id=r.rid, token_ids=tokens, text=r.detok.stream_delta(finished=bool(reason)), finish_reason=reason
    )
    if r.prompt_logprobs is not None:
        resp.prompt_logprobs.CopyFrom(r.prompt_logprobs)
        resp.prompt_logprobs.token_ids[:] = r.ids
        r.prompt_logprobs = None
    if r.params.logprobs:
        # One per token; a stop string may cut the chunk's tokens short of those received.
        resp.logprobs.extend(r.logprobs[: len(tokens)])
        resp.top_logprobs.extend(r.top_logprobs[: len(tokens)])
        del r.logprobs[: len(tokens)], r.top_logprobs[: len(tokens)]
    if reason:
        resp.usage.prompt_tokens = len(r.ids)
        resp.usage.completion_tokens = r.completion
        resp.usage.cached_prompt_tokens = r.cached
    return resp
