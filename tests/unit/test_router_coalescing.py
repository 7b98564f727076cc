"""A request's token updates that reach the router together (one poll carrying several engine
steps, or a client slower than the steps) leave as one chunk: the same tokens, text, stop and
usage as chunk by chunk, fewer chunks."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.router.client_stream import ClientStream
from pdserve.router.handles import RouterError
from pdserve.router.membership import MembershipConfig
from pdserve.router.router import Router, RouterConfig
from pdserve.router.token_stream import Stream, WorkerLost
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import worker_pb2


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i % 26)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class StepsInOnePoll:
    """A decode worker whose every poll answers with what the test scripted: one update per
    request per engine step, as the real worker's outbox holds them."""

    def __init__(self) -> None:
        self.worker_id = "decode-0"
        self.answers: asyncio.Queue[list[worker_pb2.TokenUpdate]] = asyncio.Queue()
        self.submitted = asyncio.Event()
        self.aborted: list[str] = []
        self.blocks = BlockManager(16, 16)
        self.blocks.enable_events()

    async def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> worker_pb2.DecodeSubmit:
        self.submitted.set()
        return worker_pb2.DecodeSubmit()

    async def abort(self, rid, timeout_s) -> None:
        self.aborted.append(rid)

    async def poll(self, wait_s, timeout_s, acked=None) -> worker_pb2.TokenUpdates:
        try:
            updates = await asyncio.wait_for(self.answers.get(), wait_s)
        except TimeoutError:
            updates = []
        return worker_pb2.TokenUpdates(updates=updates)

    async def health(self, timeout_s) -> worker_pb2.WorkerHealth:
        return worker_pb2.WorkerHealth(engine_alive=True)

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="decode")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch:
        await asyncio.sleep(0 if full else wait_s)
        return worker_pb2.KvEventBatch(**asdict(self.blocks.drain_events(full)))


def _steps(rid: str, tokens: list[int], last: str) -> list[worker_pb2.TokenUpdate]:
    return [
        worker_pb2.TokenUpdate(request_id=rid, token_ids=[t], finish_reason=last if i == len(tokens) - 1 else "")
        for i, t in enumerate(tokens)
    ]


def _serve(tokens: list[int], last: str, stop: list[str]) -> tuple[list[pb.GenerateResponse], list[str]]:
    async def go() -> tuple[list[pb.GenerateResponse], list[str]]:
        decode = StepsInOnePoll()
        cfg = RouterConfig(model_id="m", max_model_len=4096, vocab_size=50000, poll_wait_s=0.02,
                           membership=MembershipConfig(wait_s=0.02, min_interval_s=0.0))
        router = Router(cfg, Letters(), [], [decode])
        await router.start()
        try:
            req = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                     sampling_params=pb.SamplingParams(max_tokens=len(tokens), stop=stop))
            stream = router.generate(req)
            first = asyncio.ensure_future(anext(stream))
            await decode.submitted.wait()
            decode.answers.put_nowait(_steps("r", tokens, last))  # every step in one poll
            chunks = [await first] + [c async for c in stream]
            return chunks, decode.aborted
        finally:
            await router.stop()

    return asyncio.run(go())


def test_the_steps_of_one_poll_leave_as_one_chunk_with_every_token_and_its_text():
    chunks, aborted = _serve([0, 1, 2, 3], "length", [])
    assert len(chunks) == 1
    (c,) = chunks
    assert list(c.token_ids) == [0, 1, 2, 3] and c.text == "abcd" and c.finish_reason == "length"
    assert c.usage.completion_tokens == 4 and aborted == []


def test_a_stop_string_cuts_where_it_would_chunk_by_chunk():
    # Chunk by chunk: "a", "b", then "c" completes the stop string "bc": the stream ends there,
    # after three tokens, with the text before it; the fourth step is never sent.
    chunks, aborted = _serve([0, 1, 2, 3], "length", ["bc"])
    assert "".join(c.text for c in chunks) == "a"
    assert [t for c in chunks for t in c.token_ids] == [0, 1, 2]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 3
    assert aborted == ["r"]  # the worker stops decoding it


def _in_flight(completion: int, detok: IncrementalDetokenizer, generated: list[int] | None = None,
               prompt_logprobs: object = None, scored: bool = False) -> SimpleNamespace:
    """The fields of a router's `InFlight` that coalescing reads."""
    return SimpleNamespace(
        stream=Stream("decode-0"), completion=completion, detok=detok, generated=list(generated or []),
        prompt_logprobs=prompt_logprobs, params=SimpleNamespace(prompt_logprobs=1 if scored else None),
        logprobs=[], top_logprobs=[], d_at=SimpleNamespace(worker="decode-0"),
    )


def test_tokens_queued_behind_a_scored_first_update_join_its_chunk():
    """A scored request's first update carries its prompt logprobs; updates queued behind it
    are coalesced into the same first chunk (before `generated` counts any token) and are not
    taken for an unscored prefill."""
    r = _in_flight(completion=0, detok=IncrementalDetokenizer(None), prompt_logprobs="scored", scored=True)
    r.stream.queue.put_nowait(([1], "", [], []))
    r.stream.queue.put_nowait(([2], "length", [], []))
    assert ClientStream._take_queued(r, [0], "") == ([0, 1, 2], "length", False, None)


def test_an_unscored_first_update_of_a_scored_request_is_refused():
    r = _in_flight(completion=0, detok=IncrementalDetokenizer(None), scored=True)
    r.stream.queue.put_nowait(([1], "", [], []))
    with pytest.raises(RouterError, match="prompt_logprobs"):
        ClientStream._take_queued(r, [0], "")


def test_coalescing_stops_at_an_item_that_is_not_tokens_and_hands_it_back():
    r = _in_flight(completion=1, detok=IncrementalDetokenizer(Letters()), generated=[0])
    lost = WorkerLost("decode-0", "gone")
    for item in ([1], ""), ([2], ""), lost, ([3], ""):
        r.stream.queue.put_nowait(item)
    tokens, reason, stopped, pending = ClientStream._take_queued(r, [0], "")
    assert (tokens, reason, stopped, pending) == ([0, 1, 2], "", False, lost)
    assert r.completion == 4 and r.detok.stream_delta(finished=False) == "abc"
    assert r.stream.queue.get_nowait() == ([3], "")  # still queued, behind the failover


def test_coalescing_ends_at_a_finish_and_leaves_what_follows():
    r = _in_flight(completion=0, detok=IncrementalDetokenizer(None))
    late = WorkerLost("decode-0", "late")
    r.stream.queue.put_nowait(([1], "length"))
    r.stream.queue.put_nowait(late)
    assert ClientStream._take_queued(r, [0], "") == ([0, 1], "length", False, None)
    assert r.stream.queue.get_nowait() is late
