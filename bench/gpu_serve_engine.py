"""The offline engine's decode step at the batch sizes a serving run showed (bench/gpu_serve.py):
the same model directory on one device, every sequence decoding, the batch's mean context held
at the workload's mean decode context. bench/engine.py's way of timing (engine.step() back to
back over one device synchronization, plus the median of steps synchronized one by one), but the
batch grows in place from the smallest size asked to the largest, topping up with prompts
sized so the mean context stays on target, so that each prompt is prefilled once.

    python bench/gpu_serve_engine.py --model DIR --jobs JOBS.json --out ROWS.jsonl [--device cuda]

JOBS.json: {"chat": {"context": 1100, "batches": [47, 63]}, ...}. ROWS.jsonl gets one JSON
object a line, written as each is measured (a run cut short keeps what it finished): first
{"info": ...} (the device, the engine's limits), then one row per (workload, batch): the step
(ms, back to back), the synchronized median, the mean context, or the error that stopped it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_serve_plan import Launch, LaunchContext, Process, Server, pdserve_pythonpath
from bench.gpu_serve_procs import REPO, ServerRun
from bench.gpu_serve_report import ENGINE_JOBS, ENGINE_ROWS
from bench.gpu_serve_report import load as load_runs
from bench.gpu_serve_steps import decode_context, engine_jobs
from bench.gpu_serve_workloads import WORKLOADS

WARMUP = 3
REPS = 20
MAX_PREFILL_STEPS = 20_000  # a top-up that never finishes prefilling is an error, not a hang
ENGINE_MIN_S = 60.0  # the phase is not started with less time than this left


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class Batch:
    """The sequences decoding in one engine, grown in place; contexts as the engine reports them."""

    def __init__(self, llm: object, device: str, rng: random.Random) -> None:
        self.engine = llm.engine  # type: ignore[attr-defined]
        self.device = device
        self.rng = rng
        self.contexts: dict[str, int] = {}

    def mean_context(self) -> float:
        return statistics.mean(self.contexts.values())

    def blocks_needed(self, batch: int, prompt: int, slack: int) -> int:
        bs = self.engine.cfg.block_size
        have = sum(-(-(c + slack) // bs) for c in self.contexts.values())
        return have + (batch - len(self.contexts)) * -(-(prompt + slack) // bs)

    def top_up_prompt(self, batch: int, context: int, slack: int) -> int:
        """The prompt length that puts the batch's mean context on `context` once it holds `batch`."""
        new = batch - len(self.contexts)
        want = round((context * batch - sum(self.contexts.values())) / new)
        return max(1, min(want, self.engine.max_model_len - slack - 1))

    def grow(self, batch: int, prompt: int) -> None:
        from pdserve import SamplingParams

        engine = self.engine
        vocab = engine.model_config.vocab_size
        params = SamplingParams(max_tokens=engine.max_model_len - prompt - 1, temperature=0.0, ignore_eos=True)
        new = set()
        for _ in range(batch - len(self.contexts)):
            new.add(engine.add_request([self.rng.randrange(10, vocab) for _ in range(prompt)], params))
        for _ in range(MAX_PREFILL_STEPS):
            self._note(engine.step())
            if new <= self.contexts.keys():
                return
        raise RuntimeError(f"batch {batch}: prefill did not finish in {MAX_PREFILL_STEPS} steps")

    def _note(self, outs: Sequence[object]) -> None:
        for o in outs:
            self.contexts[o.request_id] = len(o.prompt_token_ids) + len(o.token_ids)  # type: ignore[attr-defined]

    def time_steps(self, warmup: int, reps: int) -> tuple[float, float, float]:
        """(back-to-back step seconds, median synchronized step seconds, mean context over the
        timed steps) with every sequence decoding."""
        n = len(self.contexts)
        for _ in range(warmup):
            self._note(self.engine.step())
        first = self.mean_context()
        synced = []
        for _ in range(reps):
            _sync(self.device)
            t0 = time.perf_counter()
            outs = self.engine.step()
            _sync(self.device)
            synced.append(time.perf_counter() - t0)
            if len(outs) != n:
                raise RuntimeError(f"expected a pure decode step of {n}, got {len(outs)} outputs (KV pool full?)")
            self._note(outs)
        _sync(self.device)
        t0 = time.perf_counter()
        produced = 0
        for _ in range(reps):
            outs = self.engine.step()
            produced += len(outs)
            self._note(outs)
        _sync(self.device)
        steady = (time.perf_counter() - t0) / reps
        if produced != n * reps:
            raise RuntimeError(f"expected {n * reps} tokens from {reps} decode steps, got {produced}")
        return steady, statistics.median(synced), (first + self.mean_context()) / 2

    def clear(self) -> None:
        for rid in list(self.contexts):
            self.engine.abort(rid)
        while self.engine.has_unfinished():  # a step launched ahead is still on the device: let it land
            self.engine.step()
        self.contexts.clear()


def time_batches(
    batch: Batch, workload: str, context: int, batches: Sequence[int], emit: Callable[[dict], None],
    warmup: int = WARMUP, reps: int = REPS,
) -> None:  # fmt: skip
    """A row per batch size, smallest first; once one does not fit (sequences, KV blocks) or
    fails, it and every larger one are error rows."""
    engine = batch.engine
    stop: str | None = None
    sizes = sorted(set(batches))
    try:
        for k, b in enumerate(sizes):
            # Tokens every sequence may still decode: this batch's steps and the larger ones' (with
            # their top-ups' prefill steps), which its KV blocks must hold.
            slack = (len(sizes) - k) * (warmup + 2 * reps + 16) + 32
            row: dict = {"workload": workload, "batch": b, "target_context": context}
            if stop is None and b > engine.cfg.max_num_seqs:
                stop = f"batch {b} over the engine's max_num_seqs {engine.cfg.max_num_seqs}"
            if stop is None and b > len(batch.contexts):
                # On target in the middle of the timed steps, which start after `warmup + reps` tokens.
                prompt = batch.top_up_prompt(b, context - warmup - reps, slack)
                need = batch.blocks_needed(b, prompt, slack)
                if need > engine.blocks.num_blocks:
                    stop = f"batch {b} at context {context} needs {need} KV blocks of {engine.blocks.num_blocks}"
                else:
                    try:
                        batch.grow(b, prompt)
                    except Exception as exc:  # noqa: BLE001 - the row says why; larger batches are not tried
                        stop = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            if stop is None:
                try:
                    steady, synced, mean_context = batch.time_steps(warmup, reps)
                    row |= {"step_ms": round(steady * 1e3, 4), "synced_median_ms": round(synced * 1e3, 4),
                            "context": round(mean_context)}  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    stop = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            if stop is not None:
                row |= {"step_ms": None, "error": stop}
            emit(row)
    finally:
        batch.clear()


def load_llm(model: str | None, device: str, max_model_len: int) -> object:
    """The engine as a decode worker runs it (its defaults; no detokenizing), with random weights:
    the values of the weights do not change a step's time."""
    from pdserve import LLM

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return LLM(model, device=device, dtype=dtype, load_format="dummy", max_model_len=max_model_len,
               enable_prefix_caching=False, detokenize=False)  # fmt: skip


def info(llm: object, device: str) -> dict:
    engine = llm.engine  # type: ignore[attr-defined]
    out = {"device": device, "max_num_seqs": engine.cfg.max_num_seqs, "kv_blocks": engine.blocks.num_blocks,
           "block_size": engine.cfg.block_size, "cuda_graphs": engine.runner.graphs is not None}  # fmt: skip
    if device.startswith("cuda"):
        import torch

        out["card"] = torch.cuda.get_device_name(0)
    return out


def engine_phase(out: Path, ctx: LaunchContext, scale: float, seed: int, left_s: float = float("inf")) -> str | None:
    """bench/gpu_serve.py's last phase: this module as a child on the first GPU, timing the engine
    at every decode worker's busiest-bucket batch in OUT's runs and each workload's mean decode
    context, its rows into OUT/engine_steps.jsonl as they come, within left_s seconds. Returns
    why it did not run or finish, or None."""
    runs, _ = load_runs(out)
    jobs = engine_jobs(runs)
    if not jobs:
        return "engine steps: no run in OUT carries decode step figures (pdserve_engine_step_seconds on /metrics)"
    spec = {}
    for w, batches in jobs.items():
        sample = WORKLOADS[w].requests(2000, seed, scale)
        spec[w] = {"context": decode_context((len(r.prompt), r.output_len) for r in sample), "batches": batches}
    (out / ENGINE_JOBS).write_text(json.dumps(spec, indent=1) + "\n")
    if left_s < ENGINE_MIN_S:
        return f"engine steps: not run, {max(0.0, left_s):.0f} s left; run again with --engine-steps"
    rows = out / ENGINE_ROWS
    rows.unlink(missing_ok=True)
    argv = (ctx.python, str(REPO / "bench" / "gpu_serve_engine.py"), "--model", ctx.model, "--device", ctx.device,
            "--max-model-len", str(ctx.max_model_len), "--jobs", str(out / ENGINE_JOBS), "--out", str(rows))  # fmt: skip
    env = {"PYTHONPATH": pdserve_pythonpath(ctx)}
    if ctx.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(ctx.gpu_ids[0])
    srv = ServerRun(Launch(Server("engine-steps", "engine", 1), (Process("engine", argv, env),), ""), out / "logs")
    print(f"gpu_serve: engine steps at {json.dumps(spec)}", file=sys.stderr, flush=True)
    try:
        srv.start()
        code = srv.running[0].popen.wait(timeout=None if left_s == float("inf") else left_s - 5.0)
    except subprocess.TimeoutExpired:
        return "engine steps: cut short by --budget-s (the rows measured are kept)"
    finally:
        srv.stop(grace_s=5.0)
    return None if code == 0 else f"engine steps: exited with code {code} (see {out / 'logs'})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_serve_engine.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: pdserve's default model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--jobs", type=Path, required=True, help='{"WORKLOAD": {"context": C, "batches": [B, ...]}}')
    p.add_argument("--out", type=Path, required=True, help="rows, one JSON object a line (appended)")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--reps", type=int, default=REPS)
    args = p.parse_args(argv)
    jobs = json.loads(args.jobs.read_text())
    with open(args.out, "a") as f:

        def emit(row: dict) -> None:
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"gpu_serve_engine: {json.dumps(row)}", file=sys.stderr, flush=True)

        t0 = time.monotonic()
        llm = load_llm(args.model, args.device, args.max_model_len)
        emit({"info": info(llm, args.device) | {"load_s": round(time.monotonic() - t0, 1)}})
        batch = Batch(llm, args.device, random.Random(0))
        for workload, job in jobs.items():
            time_batches(batch, workload, int(job["context"]), [int(b) for b in job["batches"]], emit,
                         args.warmup, args.reps)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
