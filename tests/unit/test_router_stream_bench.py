"""bench/router_stream.py's synthetic decode worker answers polls as `DecodeWorker.poll` does:
one numbered update per request per engine step, every update after the acked one, and a wait
for the running step when there is none."""

from __future__ import annotations

import asyncio

from bench.router_stream import SyntheticDecode, WorkerModel
from pdserve_proto import worker_pb2


def _submit(rid: str, max_tokens: int) -> worker_pb2.SubmitRequest:
    params = worker_pb2.WorkerSamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1)
    return worker_pb2.SubmitRequest(prompt_token_ids=[1, 2], params=params, request_id=rid)


def test_each_step_gives_each_request_one_numbered_update_until_its_last():
    async def go() -> list:
        d = SyntheticDecode("d0", WorkerModel(d0_ms=2.0, d1_ms=0.0))
        await d.submit(_submit("a", 3), 1.0)
        await d.submit(_submit("b", 5), 1.0)
        await asyncio.sleep(0.005)  # two steps or more have ended
        first = await d.poll(0.05, 1.0, 0)
        again = await d.poll(0.05, 1.0, 0)  # nothing acked: the same updates, and any new ones
        acked = first.updates[-1].seq
        got = list(first.updates)
        while not any(u.request_id == "b" and u.finish_reason for u in got):
            got += (await d.poll(0.05, 1.0, acked)).updates
            acked = got[-1].seq
        return [first, again, got]

    first, again, got = asyncio.run(go())
    assert len(first.updates) >= 4 and [u.seq for u in first.updates] == list(range(1, len(first.updates) + 1))
    assert list(again.updates)[: len(first.updates)] == list(first.updates)
    by = {rid: [u for u in got if u.request_id == rid] for rid in ("a", "b")}
    assert [len(by["a"]), len(by["b"])] == [3, 5]  # one token a step each
    assert all(len(u.token_ids) == 1 for u in got)
    assert [u.finish_reason for u in by["a"]] == ["", "", "length"] and by["b"][-1].finish_reason == "length"
    assert [u.seq for u in got] == list(range(1, len(got) + 1))


def test_an_idle_worker_waits_for_a_submit_or_its_wait():
    async def go() -> tuple[int, float]:
        d = SyntheticDecode("d0", WorkerModel())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        idle = await d.poll(0.05, 1.0, 0)
        return len(idle.updates), loop.time() - t0

    n, waited = asyncio.run(go())
    assert n == 0 and 0.04 <= waited < 1.0


def test_a_gpu_workload_loads_the_router_with_that_shape():
    import statistics

    from bench.router_stream import RunConfig, run_requests

    default = run_requests(RunConfig(2, 48.0, 50, ""), seed=0)
    long = run_requests(RunConfig(2, 48.0, 50, "", "long-prompt"), seed=0)
    assert statistics.median(len(r.prompt) for r in default) < 400  # `pdserve bench serve`'s chat: 256
    assert 2700 <= statistics.median(len(r.prompt) for r in long) <= 3300  # bench/gpu_serve.py's: 3,000


def test_an_unknown_gpu_workload_is_refused_naming_the_flag():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "router_stream.py"
    done = subprocess.run([sys.executable, str(script), "--gpu-workload", "nope"], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2
    assert "--gpu-workload: 'nope'; one of long-prompt, chat, prefix-sharing" in done.stderr
