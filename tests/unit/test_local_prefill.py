"""Colocated serving and conditional disaggregation without processes: the decision as a pure
function, and the router's local path with in-memory workers (placement, metrics, cleanup)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.engine.hashing import block_hashes
from pdserve.router.handles import RouterError
from pdserve.router.placement.decode_strategy import overflow_to_decode, prefill_locally
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.router import Router
from pdserve_proto import inference_pb2 as pb
from tests.unit.router_doubles import BS, FakeDecode, FakePrefill, make_router, request

# ----- the decision ----------------------------------------------------------------------------


def test_without_a_prefill_worker_every_prompt_is_prefilled_locally():
    assert prefill_locally(5000, 0, has_prefill_workers=False, max_local_prefill_tokens=0)
    assert prefill_locally(1, 0, has_prefill_workers=False, max_local_prefill_tokens=64)


def test_a_zero_threshold_always_disaggregates_when_a_prefill_pool_exists():
    assert not prefill_locally(1, 0, True, 0)
    assert not prefill_locally(64, 64, True, 0)  # even a prompt the decode worker holds whole


def test_the_threshold_counts_only_the_tokens_the_decode_worker_lacks():
    assert prefill_locally(64, 0, True, 64)
    assert not prefill_locally(65, 0, True, 64)
    assert prefill_locally(1000, 960, True, 64)  # a long prompt whose prefix the decode worker holds
    assert not prefill_locally(1000, 928, True, 64)
    assert prefill_locally(64, 64, True, 1)  # the last token is always computed: at least 1


def test_a_negative_threshold_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^max_local_prefill_tokens:"):
        PlacementConfig(max_local_prefill_tokens=-1)
    with pytest.raises(ValueError, match="^max_prefill_queue_tokens:"):
        PlacementConfig(max_prefill_queue_tokens=-1)


def test_a_backed_up_prefill_pool_overflows_only_past_the_queue_bound():
    assert overflow_to_decode(4096, 0, 4096) and overflow_to_decode(9000.0, 0, 4096)
    assert not overflow_to_decode(4095, 0, 4096)
    # No rate measured yet: one at a time, while the decode worker has no other overflowed prompt waiting.
    assert not overflow_to_decode(9000, 1, 4096)
    assert not overflow_to_decode(10**6, 0, 0)  # 0: never
    assert not overflow_to_decode(None, 0, 4096)  # every worker at its cap: the pool-full rule decides


async def ask(router: Router, rid: str, ids: list[int], max_tokens: int = 4) -> list[pb.GenerateResponse]:
    return [c async for c in router.generate(request(rid, ids, max_tokens))]


async def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def served(router: Router) -> dict[str, int]:
    return router.placement_stats()["prefills"]


def test_a_router_needs_a_decode_worker_but_no_prefill_worker():
    with pytest.raises(ValueError, match="^decodes:"):
        make_router([FakePrefill()], [])
    make_router([], [FakeDecode()])


def test_a_colocated_router_streams_every_token_from_the_decode_worker():
    async def go() -> None:
        decode = FakeDecode()
        router = make_router([], [decode])
        await router.start()
        try:
            chunks = await ask(router, "r1", list(range(100, 140)), max_tokens=5)
            assert [t for c in chunks for t in c.token_ids] == [7] * 5
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5
            assert chunks[-1].usage.cached_prompt_tokens == 0
            again = await ask(router, "r2", list(range(100, 140)), max_tokens=2)
            assert again[-1].usage.cached_prompt_tokens == 32  # two full blocks, from the decode worker's report
            assert decode.calls == [("submit", "r1"), ("submit", "r2")]
            assert served(router) == {"local": 2, "remote": 0}
            value = router.metrics.registry.get_sample_value
            assert value("pdserve_prefills_total", {"location": "local"}) == 2
            assert value("pdserve_time_to_first_token_seconds_count") == 2
            assert value("pdserve_prefill_duration_seconds_count") == 2
            assert router.placement_stats()["decode"]["prompt_tokens"] == 80
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_slow_submit_call_shows_in_its_own_histogram_within_the_prefill_wait():
    """A local prompt's first token waits for the submit call that queues it: that call's round
    trip is measured apart, so a stall there is told from one in the engine."""

    async def go() -> None:
        decode = FakeDecode()
        decode.submit_gate = asyncio.Event()
        router = make_router([], [decode])
        await router.start()
        try:
            asked = asyncio.ensure_future(ask(router, "slow", list(range(100, 140)), max_tokens=2))
            await wait_until(lambda: ("submit waiting", "slow") in decode.calls)
            await asyncio.sleep(0.3)
            decode.submit_gate.set()
            await asked
            value = router.metrics.registry.get_sample_value
            call = {"part": "call"}
            assert value("pdserve_local_prefill_submit_seconds_count", call) == 1
            submit_s = value("pdserve_local_prefill_submit_seconds_sum", call)
            assert 0.3 <= submit_s <= value("pdserve_prefill_duration_seconds_sum")
            assert value("pdserve_local_prefill_submit_seconds_bucket", {**call, "le": "0.25"}) == 0
            # The double reports no time of its own: the call is not split into its legs.
            assert value("pdserve_local_prefill_submit_seconds_count", {"part": "worker"}) is None
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_colocated_router_sends_a_prompt_where_fewer_prompt_tokens_wait_for_their_first_token():
    """Two colocated workers as loaded: the one still prefilling a long prompt is passed over
    for the one whose waiting prompt is short (by requests in flight alone, the first listed
    would take it). Each worker's prompt backlog empties at the prompts' first tokens."""

    async def go() -> None:
        d0, d1 = FakeDecode("decode-0"), FakeDecode("decode-1")
        d0.emitting.clear()
        d1.emitting.clear()
        router = make_router([], [d0, d1])
        await router.start()
        backlog = router.decode_policy.prompt_backlog
        try:
            long = asyncio.create_task(ask(router, "long", list(range(100, 100 + 10 * BS))))
            await wait_until(lambda: ("submit", "long") in d0.calls)
            short = asyncio.create_task(ask(router, "short", list(range(2000, 2000 + BS))))
            await wait_until(lambda: ("submit", "short") in d1.calls)
            assert backlog == {"decode-0": 10 * BS, "decode-1": BS}
            assert router.decode_policy.inflight == {"decode-0": 1, "decode-1": 1}
            nxt = asyncio.create_task(ask(router, "next", list(range(4000, 4000 + 2 * BS))))
            await wait_until(lambda: ("submit", "next") in d0.calls + d1.calls)
            assert ("submit", "next") in d1.calls and backlog == {"decode-0": 10 * BS, "decode-1": 3 * BS}
            d0.emitting.set()
            d1.emitting.set()
            await asyncio.gather(long, short, nxt)
            await router.drain_cleanups()
            assert backlog == {"decode-0": 0, "decode-1": 0}
            assert router.decode_policy.inflight == {"decode-0": 0, "decode-1": 0}
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_cancelled_local_request_leaves_no_prompt_backlog():
    async def go() -> None:
        decode = FakeDecode()
        decode.emitting.clear()
        router = make_router([], [decode])
        await router.start()
        try:
            held = asyncio.create_task(ask(router, "held", list(range(100, 100 + 4 * BS))))
            await wait_until(lambda: router.decode_policy.prompt_backlog == {"decode-0": 4 * BS})
            held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await held
            await router.drain_cleanups()
            assert router.decode_policy.prompt_backlog == {"decode-0": 0}
        finally:
            await router.stop()

    asyncio.run(go())


def test_closing_a_local_stream_mid_way_aborts_it_on_the_decode_worker():
    async def go() -> None:
        decode = FakeDecode()
        router = make_router([], [decode])
        await router.start()
        try:
            stream = router.generate(request("gone", list(range(40)), max_tokens=1000))
            await anext(stream)
            await anext(stream)
            await stream.aclose()
            await router.drain_cleanups()
            assert decode.calls == [("submit", "gone"), ("abort", "gone")]
            assert decode.live == {} and router.decode_policy.inflight == {"decode-0": 0}
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_cancel_during_submit_aborts_only_after_the_submit_landed():
    async def go() -> None:
        decode = FakeDecode()
        decode.submit_gate = asyncio.Event()
        router = make_router([], [decode])
        await router.start()
        try:
            task = asyncio.create_task(ask(router, "early", list(range(40)), max_tokens=1000))
            await wait_until(lambda: decode.calls == [("submit waiting", "early")])
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            assert ("abort", "early") not in decode.calls  # nothing to abort yet: the abort would be lost
            decode.submit_gate.set()
            await router.drain_cleanups()
            assert decode.calls[1:] == [("submit", "early"), ("abort", "early")]
            assert decode.live == {}
        finally:
            await router.stop()

    asyncio.run(go())


def test_conditional_disaggregation_follows_what_the_decode_worker_lacks():
    async def go() -> None:
        prefill, decode = FakePrefill(), FakeDecode()
        router = make_router([prefill], [decode], max_local=32)
        await router.start()
        try:
            await ask(router, "short", list(range(20)))
            await ask(router, "long", list(range(1000, 1160)))  # 160 tokens, none cached on the decode worker
            assert prefill.prefilled == ["long"]
            assert decode.calls == [("submit", "short"), ("start", "long")]
            # Once the decode worker's events reach the index, a longer prompt behind that prefix
            # lacks only 20 tokens there: it stays local.
            await wait_until(lambda: router.decode_policy.index.match(block_hashes(list(range(1000, 1160)), BS)).get("decode-0") == 10)
            await ask(router, "turn-2", list(range(1000, 1160)) + list(range(20)))
            assert prefill.prefilled == ["long"] and decode.calls[-1] == ("submit", "turn-2")
            assert served(router) == {"local": 2, "remote": 1}
            value = router.metrics.registry.get_sample_value
            assert value("pdserve_prefills_total", {"location": "remote"}) == 1
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_colocated_router_grows_a_prefill_pool():
    async def go() -> None:
        decode = FakeDecode()
        router = make_router([], [decode])
        await router.start()
        try:
            await ask(router, "before", list(range(40)))
            prefill = FakePrefill()
            await router.add_prefill(prefill)
            await ask(router, "after", list(range(500, 540)))
            assert prefill.prefilled == ["after"] and served(router) == {"local": 1, "remote": 1}
            assert await router.drain("prefill-0", 5.0)
            await ask(router, "drained", list(range(900, 940)))
            assert served(router) == {"local": 2, "remote": 1}  # no prefill worker left: local again
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_local_request_is_traced_through_the_submit_call():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def go() -> None:
        decode = FakeDecode()
        router = make_router([], [decode], tracer=provider.get_tracer("test"))
        await router.start()
        try:
            await ask(router, "traced", list(range(40)), max_tokens=3)
        finally:
            await router.stop()
        spans = {s.name: s for s in exporter.get_finished_spans()}
        assert set(spans) == {"pdserve.generate", "pdserve.route", "pdserve.decode.submit",
                              "pdserve.decode.first_token", "pdserve.stream"}
        root = spans["pdserve.generate"]
        assert all(s.parent.span_id == root.context.span_id for n, s in spans.items() if n != "pdserve.generate")
        route = spans["pdserve.route"].attributes
        assert route["pdserve.prefill.local"] is True and route["pdserve.decode.worker_id"] == "decode-0"
        assert "pdserve.prefill.worker_id" not in route
        # The worker's span continues the submit call's.
        submit = spans["pdserve.decode.submit"]
        assert decode.trace_contexts[0]["traceparent"].split("-")[2] == format(submit.context.span_id, "016x")
        assert spans["pdserve.stream"].attributes["pdserve.completion_tokens"] == 3
        provider.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("overflow", [True, False])
def test_a_full_prefill_pool_overflows_to_the_decode_worker(overflow):
    """Every prefill worker at its in-flight cap: the decode worker prefills the prompt itself
    (counted as an overflow), or, with that turned off, the request is refused and leaves
    nothing placed."""

    async def go() -> None:
        prefill, decode = FakePrefill(), FakeDecode()
        prefill.gate = asyncio.Event()
        router = make_router([prefill], [decode], overflow=overflow, max_inflight_per_prefill=1)
        await router.start()
        value = router.metrics.registry.get_sample_value
        try:
            first = asyncio.create_task(ask(router, "first", list(range(40))))
            await wait_until(lambda: prefill.waiting == ["first"])  # the pool's one slot is taken
            if overflow:
                chunks = await ask(router, "second", list(range(500, 540)), max_tokens=3)
                assert [t for c in chunks for t in c.token_ids] == [7] * 3
                assert ("submit", "second") in decode.calls and prefill.waiting == ["first"]
                assert value("pdserve_prefill_overflows_total") == 1
            else:
                with pytest.raises(RouterError) as err:
                    await ask(router, "second", list(range(500, 540)))
                assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert value("pdserve_prefill_overflows_total") == 0
                assert router.decode_policy.inflight == {"decode-0": 1}  # only the first holds a slot
            prefill.gate.set()
            await first
            assert prefill.prefilled == ["first"]
            assert served(router) == ({"local": 1, "remote": 1} if overflow else {"local": 0, "remote": 1})
            await router.drain_cleanups()
            assert router.decode_policy.inflight == {"decode-0": 0} and router.prefill_policy.inflight == {"prefill-0": 0}
        finally:
            await router.stop()

    asyncio.run(go())


def test_prompts_overflow_to_the_decode_worker_while_the_prefill_queue_is_over_its_bound():
    """`max_prefill_queue_tokens`: while the prefill worker has that many tokens in flight, a new
    prompt is prefilled on its decode worker (an overflow, served locally), unless that worker's
    backlog of overflowed prompts without a first token is that large too; once the queue drains,
    prompts go to the prefill pool again. Nothing stays placed or in a backlog."""

    async def go() -> None:
        prefill, decode = FakePrefill(), FakeDecode()
        prefill.gate = asyncio.Event()
        router = make_router([prefill], [decode], queue_tokens=4 * BS)
        await router.start()
        value = router.metrics.registry.get_sample_value
        backlog = router.decode_policy.overflow_backlog
        try:
            short = asyncio.create_task(ask(router, "short", list(range(3 * BS))))
            await wait_until(lambda: prefill.waiting == ["short"])
            assert router.prefill_policy.least_queued_tokens() == 3 * BS  # below the bound
            long = asyncio.create_task(ask(router, "long", list(range(1000, 1000 + 2 * BS))))
            await wait_until(lambda: prefill.waiting == ["short", "long"])  # 5 blocks in flight now
            decode.emitting.clear()  # the overflowed prompt's first token is held back
            over = asyncio.create_task(ask(router, "over", list(range(500, 500 + 5 * BS)), max_tokens=200))
            await wait_until(lambda: ("submit", "over") in decode.calls)
            assert "over" not in prefill.waiting and backlog == {"decode-0": 5 * BS}
            assert value("pdserve_prefill_overflows_total") == 1
            # The decode worker's backlog is at the bound as well: the next prompt waits for the prefill worker.
            queued = asyncio.create_task(ask(router, "queued", list(range(3000, 3000 + BS))))
            await wait_until(lambda: prefill.waiting == ["short", "long", "queued"])
            decode.emitting.set()
            await wait_until(lambda: backlog == {"decode-0": 0})  # at its first token,
            assert not over.done()  # not at its end
            assert [t for c in await over for t in c.token_ids] == [7] * 200
            prefill.gate.set()
            await asyncio.gather(short, long, queued)
            await ask(router, "after", list(range(2000, 2000 + BS)))
            assert prefill.prefilled == ["short", "long", "queued", "after"]
            assert value("pdserve_prefill_overflows_total") == 1
            assert served(router) == {"local": 1, "remote": 4}
            await router.drain_cleanups()
            assert router.decode_policy.inflight == {"decode-0": 0} and router.prefill_policy.inflight == {"prefill-0": 0}
            assert router.prefill_policy.least_queued_tokens() == 0 and backlog == {"decode-0": 0}
        finally:
            await router.stop()

    asyncio.run(go())


def test_the_prompt_rate_a_decode_worker_tells_with_its_tokens_reaches_overflow():
    """What a decode worker says with each poll's answer (the prompt tokens a second its
    step-time target leaves it) is what the router's overflow rule weighs for that worker, and
    a worker that stops saying it (no target) is weighed by its measured rate alone again."""

    async def go() -> None:
        decode = FakeDecode()
        router = make_router([FakePrefill()], [decode], queue_tokens=4 * BS)
        await router.start()
        rates = router.decode_policy.prompt_rates
        try:
            decode.prompt_rate = 321.0
            await wait_until(lambda: rates == {"decode-0": 321.0})
            assert router.decode_policy.overflow_wait_s("decode-0", 642, time.monotonic()) == 2.0
            decode.prompt_rate = None
            await wait_until(lambda: rates == {})
            assert router.decode_policy.overflow_wait_s("decode-0", 642, time.monotonic()) is None
        finally:
            await router.stop()

    asyncio.run(go())
