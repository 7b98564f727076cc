"""Bounded admission under overload, with real workers in this process (real engines, real NIXL,
real gRPC and HTTP): a flood far beyond what a small `max_queued_requests` admits is refused at
once with a retry hint, while every admitted request completes with the offline tokens and every
KV block is free afterwards."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdserve import SamplingParams
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

PROMPT = list(range(400, 440))
MAX_TOKENS = 8
FLOOD = 24  # concurrent requests, against 2 queued per pool
DEADLINE_S = 60.0  # every call's: nothing may hang
REFUSED_WITHIN_S = 10.0  # a refusal comes at once, far before any deadline


@pytest.fixture(scope="module")
def expected(offline: Any) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return offline.generate([PROMPT], params)[0].token_ids


@pytest.fixture(scope="module")
def cluster(start_shared_in_process: Any) -> Any:
    return start_shared_in_process(router_overrides={"max_queued_requests": 2})


def _flood(n: int, call: Any) -> list[Any]:
    """`call()` from n threads released together, so the requests arrive at once."""
    go = threading.Barrier(n)

    def one(_: int) -> Any:
        go.wait()
        return call()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_flood_is_refused_at_once_with_a_retry_hint_and_the_admitted_complete(cluster, expected, wait_until):
    stub = pbg.InferenceStub(cluster.channel)

    def call() -> tuple[str, Any, float]:
        request = pb.GenerateRequest(
            prompt_token_ids=PROMPT, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        )
        t0 = time.monotonic()
        stream = stub.Generate(request, timeout=DEADLINE_S)
        try:
            return "ok", [t for chunk in stream for t in chunk.token_ids], time.monotonic() - t0
        except grpc.RpcError as exc:
            return "error", exc, time.monotonic() - t0

    results = _flood(FLOOD, call)
    served = [r for kind, r, _ in results if kind == "ok"]
    refused = [(r, took) for kind, r, took in results if kind == "error"]
    assert served and refused, f"{len(served)} served, {len(refused)} refused: the flood should do both"
    assert all(tokens == expected for tokens in served)
    for exc, took in refused:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        trailing = dict(exc.trailing_metadata() or ())
        hint = trailing["retry-after-ms"]
        assert int(hint) > 0 and f"retry after {hint} ms" in exc.details()
        assert int(trailing["retry-after"]) == max(1, -(-int(hint) // 1000))  # whole seconds, as HTTP's
        assert " pool: " in exc.details()
        assert took < REFUSED_WITHIN_S
    wait_until(lambda: cluster.blocks_in_use() == 0, 15, "every KV block to be freed")
    assert {pool: q.queued for pool, q in cluster.router.queues.items()} == {"prefill": 0, "decode": 0}


def test_http_refuses_a_flood_with_429_and_retry_after(cluster, loop_thread):
    from pdserve.router.edge.http_server import start_http_server

    runner, port = loop_thread.run(start_http_server(cluster.router, "127.0.0.1", 0))
    try:
        def post() -> tuple[int, str | None, dict]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
            body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            out = resp.status, resp.getheader("Retry-After"), json.loads(resp.read())
            conn.close()
            return out

        results = _flood(FLOOD, post)
        statuses = sorted({status for status, _, _ in results})
        assert statuses == [200, 429], statuses
        for status, retry_after, body in results:
            if status == 429:
                assert retry_after is not None and int(retry_after) >= 1
                assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "resource_exhausted"
                assert "retry after" in body["error"]["message"]
            else:
                assert retry_after is None and body["choices"][0]["finish_reason"]
    finally:
        loop_thread.run(runner.cleanup())
