"""After an overload of abandoned requests a 1P1D cluster is idle again at once, with real workers
in this process (real engines, real NIXL, real gRPC): clients that give up (gRPC deadlines, or a
cancel after the first tokens) leave no KV block held, no request in any engine and no count in
the router, and the next requests complete with the offline tokens.

The prefill worker's host is made to run each prefill call a while after it was sent, and to run
it whether or not the router still waits for it: what a Ray actor does with a call queued behind
busy threads (cancelling the caller recalls nothing). A client that gives up before its prefill
call has run makes the router release the request first; the late prefill must then not be
computed for nobody, its KV pinned until its lease ends (30 s, far past this test's waits). The
decode worker's hand-over is tested the same way: an abort that overtakes its `start`."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdserve import SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.engine.args import EngineArgs
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from pdserve_proto import worker_pb2

pytestmark = pytest.mark.cluster

IN_TRANSIT_S = 2.0  # how long a delayed call waits in its worker's host before it runs
SHORT_DEADLINE_S = 0.3  # gives up before its prefill call arrives
LONG_DEADLINE_S = 3.0  # gives up during the prefill, the hand-over or the decode
MAX_TOKENS = 24
SHARED = list(range(600, 648))  # 3 blocks that half of the prompts start with
FLOOD = 16
IDLE_WITHIN_S = 10.0  # far below the prefill lease (30 s)


def prompt(i: int) -> list[int]:
    own = list(range(1000 + 40 * i, 1000 + 40 * i + 20 + i))
    return SHARED + own if i % 2 else own


NORMAL = [prompt(100), prompt(101)]


@pytest.fixture(scope="module")
def expected(offline: Any) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in offline.generate(NORMAL, params)]


class HostQueue:
    """Fault injection: the host of a worker runs its `method` calls `delay_s` after they were
    sent, and never recalls one whose caller stopped waiting (a Ray actor runs a call queued
    behind busy threads all the same); other calls run at once. Installed as the transport of
    the router's client of that worker, so the client's deadlines apply as they do over Ray."""

    def __init__(self, client: Any, method: str, delay_s: float) -> None:
        self.transport, self.method, self.delay_s = client.worker, method, delay_s
        self.sent: list[asyncio.Task] = []
        client.worker = self

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.transport, name)
        if name != self.method:
            return call

        def queued(request: Any) -> Any:
            async def deliver() -> Any:
                await asyncio.sleep(self.delay_s)
                return await call(request)

            task = asyncio.ensure_future(deliver())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # answered to nobody: no warning
            self.sent.append(task)
            return asyncio.shield(task)

        return queued

    def answers(self) -> list[str]:
        """What the worker answered each delayed call that has run: "ok" or the error it
        answered (a `WorkerError`'s message)."""
        out = []
        for t in self.sent:
            if not t.done():
                continue
            if t.exception() is not None:
                out.append(str(t.exception()))
            else:
                answer = t.result()
                out.append(answer.message if isinstance(answer, worker_pb2.WorkerError) else "ok")
        return out


def _flood(channel: grpc.Channel) -> list[str]:
    """FLOOD requests at once: a third give up before their prefill arrives, a third during
    it or later, a third cancel after their first tokens. Returns how each ended."""
    stub = pbg.InferenceStub(channel)
    go = threading.Barrier(FLOOD)

    def one(i: int) -> str:
        request = pb.GenerateRequest(
            prompt_token_ids=prompt(i),
            sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        )
        go.wait()
        deadline = (SHORT_DEADLINE_S, LONG_DEADLINE_S, 60.0)[i % 3]
        call = stub.Generate(request, timeout=deadline)
        try:
            for _ in call:
                if i % 3 == 2:
                    call.cancel()
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name

    with ThreadPoolExecutor(FLOOD) as pool:
        return list(pool.map(one, range(FLOOD)))


def test_abandoned_requests_leave_nothing_behind_and_the_next_ones_complete(
    start_in_process, model_dir, wait_until, expected, greedy
):
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=128))
    prefills: list[HostQueue] = []

    def wrap(client: Any, role: str) -> Any:
        if role == "prefill":
            prefills.append(HostQueue(client, "prefill", IN_TRANSIT_S))
        return client

    c = start_in_process(cfg, wrap_client=wrap)
    outcomes = _flood(c.channel)
    assert "DEADLINE_EXCEEDED" in outcomes and "CANCELLED" in outcomes, outcomes
    wait_until(lambda: all(t.done() for t in prefills[0].sent), 30, "every prefill call to reach the worker")
    wait_until(lambda: c.blocks_in_use() == 0, IDLE_WITHIN_S, "every KV block free on both workers")
    c.loop_thread.run(c.router.drain_cleanups())
    for w in (c.prefill, c.decode):
        assert w.engine.holds_requests() == 0, w.worker_id
        assert not w.engine.requests.seqs, f"{w.worker_id} still knows {sorted(w.engine.requests.seqs)}"
    assert c.prefill.stats().pinned_requests == 0 and c.prefill.lease_expiries == 0
    r = c.router
    assert not r.relay.streams
    assert {w: r.pools.busy(w) for w in ("prefill-0", "decode-0")} == {"prefill-0": 0, "decode-0": 0}
    assert set(r.pools.prefill_policy.inflight.values()) == {0} and set(r.pools.decode_policy.inflight.values()) == {0}
    assert {pool: q.queued for pool, q in r.queues.items()} == {"prefill": 0, "decode": 0}
    answers = prefills[0].answers()
    assert any("released before its prefill arrived" in a for a in answers), answers  # the race did happen

    stub = pbg.InferenceStub(c.channel)
    for ids, tokens in zip(NORMAL, expected):
        request = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(MAX_TOKENS, ignore_eos=True))
        assert [t for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids] == tokens
    wait_until(lambda: c.blocks_in_use() == 0, IDLE_WITHIN_S, "every KV block free after the normal requests")
    assert not c.prefill.engine.requests.seqs


def test_a_prefill_released_before_it_arrives_is_refused_and_a_served_one_is_forgotten(model_dir):
    from pdserve.cluster.workers import build_prefill
    from pdserve.prefill_worker.prefiller import PrefillCancelled

    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=64))
    worker = build_prefill("prefill-early", cfg)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        assert worker.release("late") is False  # nothing held: the router gave up before the call came
        with pytest.raises(PrefillCancelled, match="released before its prefill arrived"):
            worker.prefill(prompt(1), params, "late", timeout_s=60)
        assert worker.engine.holds_requests() == 0 and worker.stats().kv_blocks_in_use == 0
        # Served, pinned, released: the engine forgets the request along with its blocks.
        served = worker.prefill(prompt(2), params, "served", timeout_s=60)
        assert len(served.handle.block_ids) > 0
        assert worker.release("served") is True
        assert worker.engine.holds_requests() == 0 and not worker.engine.requests.seqs
        assert worker.stats().kv_blocks_in_use == 0
    finally:
        worker.close()
        worker.agent.close()


def test_a_hand_over_aborted_before_it_arrives_decodes_nothing(start_in_process, model_dir, wait_until, greedy):
    """The router's hand-over deadline passes while its `start` call is still on its way: the
    request fails, the router aborts it on the decode worker, and the late start is refused there
    instead of importing the KV and decoding the request to its end for nobody."""
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=128))
    decodes: list[HostQueue] = []

    def wrap(client: Any, role: str) -> Any:
        if role == "decode":
            decodes.append(HostQueue(client, "start", IN_TRANSIT_S))
        return client

    c = start_in_process(cfg, wrap_client=wrap, router_overrides={"decode_start_timeout_s": IN_TRANSIT_S / 4})
    request = pb.GenerateRequest(prompt_token_ids=prompt(3), sampling_params=greedy(MAX_TOKENS, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as err:
        list(pbg.InferenceStub(c.channel).Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    wait_until(lambda: all(t.done() for t in decodes[0].sent), 30, "the start call to reach the decode worker")
    assert c.decode.kv.transfers == 0 and c.decode.stats().running_requests == 0  # nothing imported, nothing decoded
    assert any("aborted before it reached this worker" in a for a in decodes[0].answers()), decodes[0].answers()
    wait_until(lambda: c.blocks_in_use() == 0, IDLE_WITHIN_S, "every KV block free on both workers")
    assert c.decode.engine.holds_requests() == 0 and c.prefill.engine.holds_requests() == 0
