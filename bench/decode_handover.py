#!/usr/bin/env python3
"""A decode worker's loop while KV arrives, against the same loop with none arriving.

A decode worker in this process and a prefill worker in its Ray actor, as `pdserve serve` hosts
it (real engines and NIXL agents; on CUDA two GPUs, decode on the second: on one GPU UCX READs
between the two fell back to TCP at ~12 MB/s), connected as a 1P1D cluster's are: every prompt
is prefilled first and left pinned, so the prefill worker computes nothing while the decode
worker is timed. Then:

- **arrivals**: hand-overs (`DecodeWorker.start`, what the router calls) at Poisson --rate, each
  request decoding --output-len tokens, its tokens taken by `poll` as the router takes them;
- **steady**: as many requests as the arrivals phase ran on average, handed over at once, then
  timed once all decode, with nothing arriving.

Per phase, from the worker's own counters: decode steps, mean batch, mean step (the
`engine.step()` call), mean loop turn (the step plus handing tokens on, its tick and the callers
let in at the lock: with steps launched ahead, the device's time per step) and each request's
mean inter-token time as `poll` saw it. What the arrivals phase adds per turn is what hand-overs
cost the running sequences.

    python bench/decode_handover.py --device cuda --shape 8b --rate 24 --output-len 256
    python bench/decode_handover.py --device cpu      (the default model, small: checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's listeners on loopback, as `pdserve serve`

from bench.engine import SHAPES
from bench.report import markdown_table
from pdserve import SamplingParams
from pdserve.cluster.workers import build_agent
from pdserve.decode_worker.decoder import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.models.resolve import resolve_model

_TOKENS = (1000, 30000)  # ordinary token ids of every model here


def _model(args: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    if args.device == "cpu":
        return str(resolve_model(None)), "auto"
    (tmp / "config.json").write_text(json.dumps(SHAPES[args.shape]))
    return str(tmp), "dummy"


def decode_engine(args: argparse.Namespace, tmp: Path, blocks: int) -> LLMEngine:
    import torch

    model, fmt = _model(args, tmp)
    return LLMEngine(EngineConfig(
        model=model, device="cpu" if args.device == "cpu" else "cuda:1",
        dtype=torch.float32 if args.device == "cpu" else torch.bfloat16,
        load_format=fmt, role="decode", num_kv_blocks=blocks, max_model_len=args.prompt_len + args.output_len + 64,
        enable_prefix_caching=False, seed=7,
    ))  # fmt: skip


def prefill_actor(args: argparse.Namespace, tmp: Path, blocks: int) -> object:
    """The prefill worker in its Ray actor (`pdserve.cluster.actors`), its KV leased for an hour."""
    import ray

    from pdserve.cluster.actors import remote_class
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    model, fmt = _model(args, tmp)
    cfg = ServeConfig(
        model=model, device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16", lease_s=3600.0,
        engine=EngineArgs(load_format=fmt, num_kv_blocks=blocks, max_model_len=args.prompt_len + args.output_len + 64),
    )  # fmt: skip
    actor = remote_class(num_gpus=1 if args.device == "cuda" else 0).remote("prefill", "p0", cfg)
    ray.get(actor.identity.remote(), timeout=600)
    return actor


class Tokens:
    """What `poll` hands the router: each request's token arrival times, from a thread that polls."""

    def __init__(self, decode: DecodeWorker) -> None:
        self.decode = decode
        self.times: dict[str, list[float]] = {}
        self.finished: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for u in self.decode.poll(0.05).updates:
                now = time.perf_counter()
                self.times.setdefault(u.request_id, []).extend([now] * len(u.token_ids))
                if u.finish_reason:
                    self.finished.add(u.request_id)

    def wait_finished(self, rids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not set(rids) <= self.finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(set(rids) - self.finished)} requests did not finish in {timeout_s:g} s")
            time.sleep(0.01)

    def mean_itl_ms(self, rids: list[str]) -> float:
        itl = [(t[-1] - t[0]) / (len(t) - 1) for r in rids if len(t := self.times.get(r, [])) > 1]
        return 1e3 * statistics.fmean(itl) if itl else float("nan")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def counters(decode: DecodeWorker) -> tuple[int, float, int, int, float]:
    """(decode-only steps, their seconds, their sequences, loop turns, loop seconds) so far."""
    s = decode.stats()
    steps = [t for t in s.step_times if t.kind == "decode"]
    return (sum(t.count for t in steps), sum(t.sum_seconds for t in steps), sum(t.sequences for t in steps),
            s.loop_turns, s.loop_seconds)  # fmt: skip


def phase_row(name: str, rate: str, before: tuple, after: tuple, itl_ms: float, starts: list[float]) -> list[str]:
    steps, secs, seqs, turns, turn_s = (a - b for a, b in zip(after, before))
    return [
        name, rate, str(steps), f"{seqs / steps:.1f}" if steps else "-", f"{1e3 * secs / steps:.2f}" if steps else "-",
        str(turns), f"{1e3 * turn_s / turns:.2f}" if turns else "-", f"{itl_ms:.2f}",
        f"{1e3 * statistics.median(starts):.1f}" if starts else "-",
    ]  # fmt: skip


# Loop turns count every turn that found work, decode steps only decode-only ones: a turn
# that waited on KV still arriving, or stepped a shorter kind, can bring the mean turn under the
# mean decode step, while the turns' seconds always hold the steps'.
HEAD = ["phase", "hand-overs/s", "decode steps", "mean batch", "mean step ms", "loop turns", "mean turn ms",
        "mean ITL ms (poll)", "start call ms (median)"]  # fmt: skip


def run(args: argparse.Namespace) -> list[list[str]]:
    rng = np.random.default_rng(args.seed)
    n_arrivals = max(4, round(args.rate * args.duration_s))
    per_seq = -(-(args.prompt_len + args.output_len + 16) // 16)
    import ray

    from pdserve.cluster.ray_init import init_ray
    from pdserve.router.calls import worker_params
    from pdserve_proto import worker_pb2

    with tempfile.TemporaryDirectory() as tmp:
        # The decode worker first, on the second GPU; then Ray, started with the first alone
        # visible, places the prefill worker there (CUDA in this process already has both).
        de = decode_engine(args, Path(tmp), per_seq * (args.steady_max + n_arrivals // 2 + 8))
        if args.device == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        init_ray(None, worker_logs=True)
        prefill = prefill_actor(args, Path(tmp), per_seq * (n_arrivals + args.steady_max + 8))
        decode = DecodeWorker("d0", de, build_agent("d0", de))
        decode.agent.connect(ray.get(prefill.agent_info.remote(), timeout=60))
        ray.get(prefill.connect.remote(decode.agent.info()), timeout=60)
        tokens = Tokens(decode)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        wire = worker_params(params)
        prompts: dict[str, list[int]] = {}
        pool = ThreadPoolExecutor(64)

        def prefilled(rid: str):
            prompts[rid] = rng.integers(*_TOKENS, args.prompt_len).tolist()
            call = worker_pb2.PrefillRequest(prompt_token_ids=prompts[rid], params=wire, request_id=rid, timeout_s=600)
            result = ray.get(prefill.prefill.remote(call), timeout=660)
            if not isinstance(result, worker_pb2.PrefillResult):
                raise RuntimeError(f"prefill of {rid}: {result}")  # noqa: TRY004 - a worker's error answer
            return rid, result

        def hand_over(rid: str, result, starts: list[float]) -> None:
            t = time.perf_counter()
            decode.start(prompts[rid], params, rid, result)
            starts.append(time.perf_counter() - t)

        try:
            warm = dict(pool.map(prefilled, [f"warm-{i}" for i in range(4)]))
            for rid, res in warm.items():
                hand_over(rid, res, [])
            tokens.wait_finished(list(warm), 300)
            # Arrivals: every prompt prefilled first, then handed over at Poisson times.
            done = dict(pool.map(prefilled, [f"a-{i}" for i in range(n_arrivals)]))
            gaps = rng.exponential(1.0 / args.rate, n_arrivals)
            starts: list[float] = []
            before, due, started = counters(decode), time.perf_counter(), []
            for rid, gap in zip(done, gaps):
                due += gap
                time.sleep(max(0.0, due - time.perf_counter()))
                started.append(pool.submit(hand_over, rid, done[rid], starts))
            for f in started:
                f.result()
            tokens.wait_finished(list(done), 600)
            after = counters(decode)
            rows = [phase_row("arrivals", f"{args.rate:g}", before, after, tokens.mean_itl_ms(list(done)), starts)]
            batch = max(1, min(args.steady_max, round((after[2] - before[2]) / max(1, after[0] - before[0]))))
            # Steady: that many requests at once; timed once all of them decode.
            steady = dict(pool.map(prefilled, [f"s-{i}" for i in range(batch)]))
            list(pool.map(lambda rid: hand_over(rid, steady[rid], []), steady))
            while any(len(tokens.times.get(r, [])) < 2 for r in steady):
                time.sleep(0.005)
            before = counters(decode)
            # Until the first of them is nearly done: the batch stays whole for the whole window.
            while min(len(tokens.times.get(r, [])) for r in steady) < 0.8 * args.output_len:
                time.sleep(0.005)
            after = counters(decode)
            tokens.wait_finished(list(steady), 600)
            rows.append(phase_row("steady", "0", before, after, tokens.mean_itl_ms(list(steady)), []))
        finally:
            tokens.stop()
            pool.shutdown(wait=True)
            decode.close()
            ray.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="model shape on a GPU (random weights)")
    p.add_argument("--rate", type=float, default=None, help="hand-overs a second (default: 24 on a GPU, 2 on CPU)")
    p.add_argument("--duration-s", type=float, default=8.0, help="seconds of hand-overs")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: 1000 on a GPU, 48 on CPU)")
    p.add_argument("--output-len", type=int, default=None, help="tokens each request decodes (default: 256, 24 on CPU)")
    p.add_argument("--steady-max", type=int, default=128, help="the most requests the steady phase runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if gpu:
        import torch

        if torch.cuda.device_count() < 2:
            p.error("--device cuda needs two GPUs (prefill on the first, decode on the second)")
    args.rate = args.rate or (24.0 if gpu else 2.0)
    args.prompt_len = args.prompt_len or (1000 if gpu else 48)
    args.output_len = args.output_len or (256 if gpu else 24)
    rows = run(args)
    print(f"{args.device} {args.shape if gpu else 'default model'}: prompts of {args.prompt_len} tokens, "
          f"{args.output_len} decoded each; the prefill worker idle while timed")
    print(markdown_table(HEAD, rows))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(HEAD, r)) for r in rows], indent=1))


if __name__ == "__main__":
    main()
