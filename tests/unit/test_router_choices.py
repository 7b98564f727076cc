"""`n > 1` in the router (router/choices.py): the choices' requests (ids, seeds), their messages
interleaved with an index each, the later choices placed where the first one decodes, and a
failing or closed request ending every choice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.engine.sampling_params import MAX_N, MAX_SEED
from pdserve.router.choices import ChoiceAnchor, choice_count, choice_request, fan_out
from pdserve.router.handles import RouterError
from pdserve_proto import inference_pb2 as pb


def _request(n: int, seed: int | None = None) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=3, n=n)
    if seed is not None:
        sp.seed = seed
    return pb.GenerateRequest(request_id="r", prompt="hi", sampling_params=sp)


def test_choice_count_is_bounded_and_names_the_field():
    assert choice_count(pb.SamplingParams()) == 1
    assert choice_count(pb.SamplingParams(n=MAX_N)) == MAX_N
    for bad in (0, MAX_N + 1):
        with pytest.raises(RouterError) as err:
            choice_count(pb.SamplingParams(n=bad))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message.startswith("sampling_params.n:")


def test_choice_requests_have_their_own_ids_and_seeds():
    req = _request(3, seed=MAX_SEED - 1)
    subs = [choice_request(req, i) for i in range(3)]
    assert [s.request_id for s in subs] == ["r", "r-1", "r-2"]
    assert [s.sampling_params.seed for s in subs] == [MAX_SEED - 1, MAX_SEED, 0]  # seed + i, mod 2^64
    assert not any(s.sampling_params.HasField("n") for s in subs)
    assert req.sampling_params.n == 3 and req.request_id == "r"  # the caller's request is not changed
    unseeded = choice_request(_request(2), 1)
    assert not unseeded.sampling_params.HasField("seed")


class _Choices:
    """A stand-in for the router's serving of one choice: choice 0 'decodes' on worker d1
    after its first message; each choice sends `tokens` messages, the last with a finish reason."""

    def __init__(self, tokens: int = 3, fail: int | None = None) -> None:
        self.tokens = tokens
        self.fail = fail
        self.calls: list[tuple[str, str | None, int]] = []
        self.closed: list[str] = []
        self.running = 0

    async def serve(
        self, sub: pb.GenerateRequest, decode_on: str | None, anchor: ChoiceAnchor | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls.append((sub.request_id, decode_on, sub.sampling_params.seed))
        index = int(sub.request_id.rpartition("-")[2]) if "-" in sub.request_id else 0
        self.running += 1
        try:
            for k in range(self.tokens):
                if anchor is not None and k == 1:
                    anchor.set("d1")
                if self.fail == index and k == 1:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, "decode pool: gone")
                last = k == self.tokens - 1
                yield pb.GenerateResponse(request_id=sub.request_id, token_ids=[100 * index + k],
                                          finish_reason="length" if last else "")  # fmt: skip
                await asyncio.sleep(0)
        finally:
            self.running -= 1
            self.closed.append(sub.request_id)


async def _collect(stream: AsyncIterator[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    return [out async for out in stream]


def test_choices_interleave_with_their_index_after_the_first_decodes():
    choices = _Choices()
    out = asyncio.run(_collect(fan_out(choices.serve, _request(3, seed=5), 3)))
    assert {o.request_id for o in out} == {"r"}
    by_index = {i: [t for o in out if o.index == i for t in o.token_ids] for i in range(3)}
    assert by_index == {0: [0, 1, 2], 1: [100, 101, 102], 2: [200, 201, 202]}
    assert [o.index for o in out if o.finish_reason] != [] and sum(1 for o in out if o.finish_reason) == 3
    # Choice 0 first, placed as any request; the others on the worker it decodes on, seeded seed + i.
    assert choices.calls[0] == ("r", None, 5)
    assert sorted(choices.calls[1:]) == [("r-1", "d1", 6), ("r-2", "d1", 7)]
    # No later choice started before choice 0 was decoding (its second message).
    assert [o.index for o in out][:2] == [0, 0]


def test_a_failing_choice_fails_the_request_and_ends_the_others():
    choices = _Choices(tokens=50, fail=2)

    async def run() -> None:
        with pytest.raises(RouterError) as err:
            await _collect(fan_out(choices.serve, _request(3), 3))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
    assert choices.running == 0 and sorted(choices.closed) == ["r", "r-1", "r-2"]


def test_closing_the_stream_closes_every_choice():
    choices = _Choices(tokens=1000)

    async def run() -> None:
        stream = fan_out(choices.serve, _request(4), 4)
        seen = set()
        async for out in stream:
            seen.add(out.index)
            if len(seen) == 4:
                break
        await stream.aclose()

    asyncio.run(run())
    assert choices.running == 0 and sorted(choices.closed) == ["r", "r-1", "r-2", "r-3"]


def test_a_first_choice_that_ends_before_decoding_lets_the_others_place_freely():
    choices = _Choices(tokens=1)  # ends with its first message: never sets the anchor
    out = asyncio.run(_collect(fan_out(choices.serve, _request(2), 2)))
    assert sorted(o.index for o in out) == [0, 1]
    assert choices.calls[1] == ("r-1", None, 0)


def test_stream_metrics_take_latencies_from_the_first_choice_and_count_every_token():
    from opentelemetry import trace

    from pdserve.router.stats import StreamMetrics
    from pdserve.telemetry.metrics import RouterMetrics

    class Window:
        def __init__(self) -> None:
            self.samples: list[tuple[float, float | None]] = []

        def add(self, now: float, ttft: float, itl: float | None) -> None:
            self.samples.append((ttft, itl))

    metrics, window = RouterMetrics(), Window()
    observed = StreamMetrics(metrics, trace.NoOpTracer().start_span("r"), window)  # type: ignore[arg-type]
    for index, tokens, reason in [(0, 1, ""), (0, 1, ""), (1, 1, ""), (1, 2, "length"), (0, 1, "stop")]:
        observed.chunk(pb.GenerateResponse(index=index, token_ids=[5] * tokens, finish_reason=reason))
    value = lambda name: metrics.registry.get_sample_value(name)
    assert value("pdserve_generation_tokens_total") == 6
    assert value("pdserve_time_to_first_token_seconds_count") == 1
    assert value("pdserve_inter_token_latency_seconds_count") == 2  # choice 0's two gaps only
    assert len(window.samples) == 1 and observed.outcome == "stop"


def test_n_choices_through_the_http_edge_over_worker_doubles():
    import json

    import aiohttp

    from tests.unit.edge_server import OnePollDecode, served

    async def run() -> tuple[dict, list[dict], list[str]]:
        async with served(decode=OnePollDecode()) as s, aiohttp.ClientSession() as http:
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "n": 3}
            async with http.post(f"{s.http}/v1/completions", json=body) as r:
                whole = await r.json()
            stream = body | {"stream": True, "stream_options": {"include_usage": True}}
            async with http.post(f"{s.http}/v1/completions", json=stream) as r:
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
            return whole, [json.loads(e) for e in events[:-1]], events[-1:]

    whole, events, done = asyncio.run(run())
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert {c["finish_reason"] for c in whole["choices"]} == {"length"}
    assert whole["usage"]["completion_tokens"] == 12 and whole["usage"]["prompt_tokens"] == 3
    per_choice = {i: [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i] for i in range(3)}
    for chunks in per_choice.values():
        assert [bool(c["finish_reason"]) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert events[-1]["usage"]["completion_tokens"] == 12 and done == ["[DONE]"]
