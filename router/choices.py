"""`n > 1`: several completions of one prompt, the prompt prefilled once. Choice 0 is served as
any request; once it decodes, choices 1..n-1 go to its decode worker and are prefilled there,
taking the prompt's full blocks from that worker's prefix cache by reference and computing only
the tail past the last full block (vLLM's way: a child request per choice). Choice i draws as a
request of its own with seed + i (mod 2^64) would. `fan_out` runs the choices concurrently and
interleaves their messages, each tagged with its `index`; a failing choice fails the request,
and closing the stream closes every choice (docs/operations.md, "Several choices")."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.engine.sampling_params import MAX_N, MAX_SEED
from pdserve.router.handles import RouterError
from pdserve_proto import inference_pb2

__all__ = ["ChoiceAnchor", "choice_count", "choice_request", "fan_out", "serve_choices"]


class ChoiceAnchor:
    """Where choice 0 decodes, once it does (None: it ended, or failed, before decoding; the
    other choices are then placed as any request is)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.worker: str | None = None

    def set(self, worker: str | None) -> None:
        """Record the decode worker (first call wins)."""
        if not self._event.is_set():
            self.worker = worker
            self._event.set()

    async def wait(self) -> str | None:
        await self._event.wait()
        return self.worker


# Serves one choice: (its request, the decode worker to prefill it on or None, the anchor choice 0 sets or None).
ServeOne = Callable[
    [inference_pb2.GenerateRequest, "str | None", "ChoiceAnchor | None"], AsyncIterator[inference_pb2.GenerateResponse]
]


def choice_count(sp: inference_pb2.SamplingParams) -> int:
    """The request's `n` (1 when unset); INVALID_ARGUMENT naming it when out of [1, MAX_N]."""
    if not sp.HasField("n"):
        return 1
    if not 1 <= sp.n <= MAX_N:
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling_params.n: must be in [1, {MAX_N}], got {sp.n}")
    return sp.n


def serve_choices(request: inference_pb2.GenerateRequest, serve_one: ServeOne) -> AsyncIterator[inference_pb2.GenerateResponse]:
    """The request's messages: served as one sequence, or as `n > 1` choices (`fan_out`; a
    request without an id gets one, since the choices' ids derive from it)."""
    n = choice_count(request.sampling_params)
    if n == 1:
        return serve_one(request, None, None)
    if not request.request_id:
        named = inference_pb2.GenerateRequest()
        named.CopyFrom(request)
        named.request_id = f"req-{uuid.uuid4().hex}"
        request = named
    return fan_out(serve_one, request, n)


def choice_request(request: inference_pb2.GenerateRequest, index: int) -> inference_pb2.GenerateRequest:
    """The request choice `index` is served as: n cleared, its own request id (choice 0 keeps
    the request's), a seeded request's seed moved on by `index`, and prompt_logprobs left to
    choice 0."""
    sub = inference_pb2.GenerateRequest()
    sub.CopyFrom(request)
    sub.sampling_params.ClearField("n")
    if index:
        sub.request_id = f"{request.request_id}-{index}"
        sub.sampling_params.ClearField("prompt_logprobs")  # choice 0's answer carries them; prefix hits for the rest
        if request.sampling_params.HasField("seed"):
            sub.sampling_params.seed = (request.sampling_params.seed + index) % (MAX_SEED + 1)
    return sub


async def fan_out(serve_one: ServeOne, request: inference_pb2.GenerateRequest, n: int) -> AsyncIterator[inference_pb2.GenerateResponse]:
    """The messages of `n` choices of `request` (whose request_id is set), as they come, each
    with its `index` and the request's id. Choices 1..n-1 start once choice 0 decodes (or ended)."""
    queue: asyncio.Queue[tuple[int, inference_pb2.GenerateResponse | Exception | None]] = asyncio.Queue()
    anchor = ChoiceAnchor()

    async def run(index: int, decode_on: str | None) -> None:
        try:
            chunks = serve_one(choice_request(request, index), decode_on, anchor if index == 0 else None)
            async with contextlib.aclosing(chunks) as stream:
                async for out in stream:
                    out.index = index
                    out.request_id = request.request_id
                    queue.put_nowait((index, out))
        except Exception as exc:  # the merged stream raises it; CancelledError (a close) is not one
            queue.put_nowait((index, exc))
            return
        finally:
            if index == 0:
                anchor.set(None)  # ended (or failed) without decoding: the others place freely
        queue.put_nowait((index, None))

    async def run_rest() -> None:
        worker = await anchor.wait()
        for index in range(1, n):
            tasks.append(asyncio.create_task(run(index, worker), name=f"choice-{index}"))

    tasks = [asyncio.create_task(run(0, None), name="choice-0"), asyncio.create_task(run_rest(), name="choices")]
    ended = 0
    try:
        while ended < n:
            _, item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # Each choice's own cleanup (aborts on its workers) runs as its task unwinds.
        await asyncio.gather(*tasks, return_exceptions=True)
