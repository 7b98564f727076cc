"""One engine under timed arrivals, for bench/engine_replay.py: pdserve's `LLMEngine` or vLLM's
(in this process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, the serving defaults of
`vllm serve`), stepped back to back; each request is added at the first step boundary after its
arrival time. It writes when each request arrived, got its first token and ended, and every
step's wall time and what it carried.

Imports only the standard library and the engine under test: vLLM runs with its own site folder
alone on PYTHONPATH, and nothing of this checkout may shadow its imports.

    python bench/engine_replay_child.py TRACE.json OUT.json
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any


class PdserveEngine:
    """pdserve's engine as a colocated worker runs it: the router detokenizes, so it does not."""

    def __init__(self, model: str, max_model_len: int, device: str) -> None:
        from pdserve import LLM

        self.llm = LLM(model, device=device, load_format="dummy", max_model_len=max_model_len, detokenize=False)
        self.engine = self.llm.engine

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        from pdserve import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(prompt, params, request_id=rid)

    def step(self) -> list[tuple[str, int, bool]]:
        return [(o.request_id, len(o.new_token_ids), o.finished) for o in self.engine.step()]

    def busy(self) -> bool:
        return self.engine.has_unfinished()


class VllmEngine:
    """vLLM's V1 engine in this process, configured as `vllm serve` configures it (its usage
    context picks the serving defaults: token budget and sequences per step for this card)."""

    def __init__(self, model: str, max_model_len: int, device: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(model=model, load_format="dummy", max_model_len=max_model_len)
        self.engine = LLMEngine.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER)
        self.seen: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        self.seen[rid] = 0

    def step(self) -> list[tuple[str, int, bool]]:
        out = []
        for o in self.engine.step():
            n = len(o.outputs[0].token_ids) if o.outputs else 0  # cumulative: the new ones are past `seen`
            new, self.seen[o.request_id] = n - self.seen.get(o.request_id, 0), n
            out.append((o.request_id, new, o.finished))
        return out

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


ENGINES = {"pdserve": PdserveEngine, "vllm": VllmEngine}


def drain(engine: Any) -> None:
    while engine.busy():
        engine.step()


def warm_up(engine: Any, prompts: list[list[int]]) -> None:
    """Every prompt length of the trace's range once, then a batch of them decoding, so no
    first-time compilation or allocation falls into the timed run."""
    for i, p in enumerate(prompts):
        engine.add(f"warm-{i}", p, 4)
        drain(engine)
    for i, p in enumerate(prompts * 4):
        engine.add(f"warm-batch-{i}", p, 16)
    drain(engine)


def replay(engine: Any, requests: list[dict]) -> tuple[dict[str, dict], list[list[float]]]:
    """Add each request at its arrival (seconds after the start), step until all are done."""
    order = sorted(requests, key=lambda r: r["arrival_s"])
    seen = {r["id"]: {"arrival_s": r["arrival_s"], "first_s": None, "end_s": None, "tokens": 0} for r in order}
    steps: list[list[float]] = []  # [start s, wall ms, rows with a token, rows with their first]
    t0 = time.perf_counter()
    i = 0
    while i < len(order) or engine.busy():
        now = time.perf_counter() - t0
        while i < len(order) and order[i]["arrival_s"] <= now:
            r = order[i]
            engine.add(r["id"], r["prompt"], r["max_tokens"])
            i += 1
        if not engine.busy():
            time.sleep(max(0.0, order[i]["arrival_s"] - now))
            continue
        start = time.perf_counter()
        outs = engine.step()
        end = time.perf_counter()
        firsts = 0
        for rid, new, finished in outs:
            rec = seen.get(rid)
            if rec is None or new <= 0 and not finished:
                continue
            if rec["first_s"] is None and new > 0:
                rec["first_s"] = end - t0
                firsts += 1
            rec["tokens"] += new
            if finished:
                rec["end_s"] = end - t0
        steps.append([round(start - t0, 6), round(1e3 * (end - start), 4), len(outs), firsts])
    return seen, steps


def _kernels(prof: Any, cuda: bool) -> list[list]:
    """[name, µs, count] of every GPU kernel the profiler saw (on CPU: every operator's own time)."""
    from torch.autograd import DeviceType

    if not cuda:
        return [[e.key, e.self_cpu_time_total, e.count] for e in prof.key_averages() if e.self_cpu_time_total > 0]
    return [[e.key, e.self_device_time_total, e.count] for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]  # fmt: skip


def profile_steps(engine: Any, batch: int, context: int, chunk: int, vocab: int, steps: int = 8) -> dict:
    """Kernels of `steps` decode steps at `batch` sequences of ~`context` tokens, then of the
    steps that take one more `chunk`-token prompt to its first token beside them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else lambda: None
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    rng = random.Random(11)
    for i in range(batch):
        engine.add(f"prof-{i}", [rng.randrange(vocab) for _ in range(context)], 4096)
    started: set[str] = set()
    while len(started) < batch:
        started.update(rid for rid, new, _ in engine.step() if new > 0)
    for _ in range(5):
        engine.step()
    sync()
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        decode_wall = time.perf_counter() - t0
    decode = {"steps": steps, "wall_ms": round(1e3 * decode_wall, 3), "kernels": _kernels(prof, cuda)}
    engine.add("prof-chunk", [rng.randrange(vocab) for _ in range(chunk)], 2)
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        n = 0
        while True:
            n += 1
            if any(rid == "prof-chunk" and new > 0 for rid, new, _ in engine.step()):
                break
        sync()
        mixed_wall = time.perf_counter() - t0
    mixed = {"steps": n, "wall_ms": round(1e3 * mixed_wall, 3), "kernels": _kernels(prof, cuda)}
    return {"batch": batch, "context": context, "chunk": chunk, "decode": decode, "mixed": mixed}


def main(argv: list[str]) -> int:
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # bench/'s modules must not shadow the engine's imports
    trace_path, out_path = argv
    with open(trace_path) as f:
        trace = json.load(f)
    engine = ENGINES[trace["engine"]](trace["model"], trace["max_model_len"], trace["device"])
    warm_up(engine, trace["warmup_prompts"])
    seen, steps = replay(engine, trace["requests"])
    rec = {"engine": trace["engine"], "requests": seen, "steps": steps}
    if trace.get("profile"):  # after the timed run: the profiler does not slow it
        p = trace["profile"]
        rec["profile"] = profile_steps(engine, p["batch"], p["context"], p["chunk"], p["vocab"])
    with open(out_path, "w") as f:
        json.dump(rec, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
