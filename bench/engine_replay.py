#!/usr/bin/env python3
"""Two engines under the same timed arrivals on one GPU, without servers: pdserve's engine
against vLLM's, each stepped back to back in a process of its own (bench/engine_replay_child.py).

What `bench/gpu_serve.py` measures is a whole server: the front door, the worker's loop and the
engine. This takes the servers away. The same requests (a workload of gpu_serve.py's, Poisson
arrivals at --rate a GPU, the same seed) go to each engine as it steps, added at the first step
boundary after they arrive. Where both engines keep pace here but a server does not, the gap is
in the serving path; where one engine falls behind here, it is the engine (its steps' count and
length say which steps).

vLLM's engine is configured as `vllm serve` configures it (its serving defaults for the card),
in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), with its own site folder alone on PYTHONPATH.
Neither engine detokenizes, as neither does in serving (vLLM's API server and pdserve's router do).

    python bench/engine_replay.py --shape 8b --workload chat --rate 24 --vllm-site SITE --out OUT
    python bench/engine_replay.py --device cpu --engines pdserve --shape tiny --rate 4   (the check without a GPU)

--profile BATCH,CONTEXT,CHUNK adds, after the timed run, each engine's kernels (torch's profiler,
in the engine's own process) for decode steps at BATCH sequences of CONTEXT tokens, and for the
steps that take one more CHUNK-token prompt to its first token beside them, by kind of kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_serve_plan import VLLM_ENV
from bench.gpu_serve_workloads import WORKLOADS
from bench.mixed_step import SHAPE_CONFIGS
from bench.random_model import write_tokenizer
from bench.report import markdown_table
from bench.serve_metrics import RequestResult, Slo, summarize
from bench.serve_workload import poisson_arrivals

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "bench" / "engine_replay_child.py"


def model_config(shape: str, max_model_len: int) -> dict:
    return {**SHAPE_CONFIGS[shape], "max_position_embeddings": max_model_len}


def write_model(folder: Path, shape: str, max_model_len: int) -> dict:
    """A random shape's config and tokenizer (both engines draw dummy weights from it)."""
    cfg = model_config(shape, max_model_len)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer(folder, cfg["vocab_size"], cfg.get("bos_token_id"), cfg.get("eos_token_id"))
    return cfg


def build_trace(workload: str, rate: float, duration_s: float, seed: int, scale: float, vocab: int) -> list[dict]:
    """The requests of one run, with their arrivals: what gpu_serve.py would send one GPU."""
    n = max(4, round(rate * duration_s))
    reqs = WORKLOADS[workload].requests(n, seed, scale)
    arrivals = poisson_arrivals(n, rate, seed)
    return [{"id": f"r{i}", "arrival_s": round(at, 6), "prompt": [t % vocab for t in r.prompt], "max_tokens": r.output_len}
            for i, (r, at) in enumerate(zip(reqs, arrivals))]  # fmt: skip


def warmup_prompts(trace: list[dict], vocab: int, seed: int) -> list[list[int]]:
    """Random prompts at the trace's shortest, median and longest lengths."""
    lengths = sorted(len(r["prompt"]) for r in trace)
    rng = random.Random(seed + 7)
    picks = sorted({lengths[0], lengths[len(lengths) // 2], lengths[-1]})
    return [[rng.randrange(vocab) for _ in range(n)] for n in picks]


def child_env(engine: str, vllm_site: str | None, gpu: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "vllm":
        if not vllm_site:
            raise ValueError("--vllm-site: needed to run vLLM's engine (its site folder, pip --target)")
        env |= VLLM_ENV | {"PYTHONPATH": vllm_site}
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def run_engine(engine: str, trace: dict, out: Path, python: str, env: dict[str, str], timeout_s: float) -> dict:
    """One child: its record, or {"error": why} (its log's tail)."""
    tpath, rpath, log = out / f"trace-{engine}.json", out / f"replay-{engine}.json", out / f"replay-{engine}.log"
    tpath.write_text(json.dumps({**trace, "engine": engine}))
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([python, str(CHILD), str(tpath), str(rpath)], env=env, cwd=out, stdout=f,
                                stderr=subprocess.STDOUT, timeout=timeout_s, check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not rpath.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"engine": engine, "error": f"{engine}: exit {rc}: {' / '.join(tail)[:300]}"}
    rec = json.loads(rpath.read_text())
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    return rec


def results_of(rec: dict, trace: list[dict]) -> list[RequestResult]:
    prompts = {r["id"]: len(r["prompt"]) for r in trace}
    out = []
    for rid, r in rec["requests"].items():
        first, end = r["first_s"], r["end_s"]
        error = None if first is not None and end is not None else "never finished"
        out.append(RequestResult(r["arrival_s"], None if first is None else first - r["arrival_s"],
                                 end if end is not None else r["arrival_s"], r["tokens"], prompts[rid], error))  # fmt: skip
    return out


def step_figures(steps: list[list[float]]) -> dict:
    """Steps where some prompt ended (got its first token) and the others: count and mean ms."""
    firsts = [s[1] for s in steps if s[3] > 0]
    others = [s[1] for s in steps if s[3] == 0]

    def mean(xs: list[float]) -> float | None:
        return round(statistics.fmean(xs), 3) if xs else None

    return {"steps": len(steps), "mean_ms": mean([s[1] for s in steps]), "with_first_token": len(firsts),
            "with_first_token_ms": mean(firsts), "others": len(others), "others_ms": mean(others),
            "median_others_ms": round(statistics.median(others), 3) if others else None,
            "mean_rows": mean([s[2] for s in steps])}  # fmt: skip


def summary_rows(recs: list[dict], trace: list[dict], slo: Slo) -> list[dict]:
    rows = []
    for rec in recs:
        if "error" in rec:
            rows.append({"engine": rec["engine"], "error": rec["error"]})
            continue
        results = results_of(rec, trace)
        duration = max(r.end for r in results) - min(r.start for r in results)
        rows.append({"engine": rec["engine"], "summary": summarize(results, max(duration, 1e-6), slo),
                     "steps": step_figures(rec["steps"])})  # fmt: skip
    return rows


# Kernel kinds by name; the first that matches. Both engines' attention, matmul and fused
# elementwise kernels (pdserve's Triton ones, vLLM's inductor-generated `triton_` ones).
KERNEL_KINDS = (
    ("attention", ("flash", "attn", "attention", "split_kv", "reshape_and_cache", "concat_and_cache")),
    ("matmul", ("nvjet", "gemm", "xmma", "cutlass", "gemv", "sm90_", "aten::mm", "aten::addmm", "aten::linear")),
    ("copy", ("memcpy", "memset", "copy", "aten::cat", "aten::index")),
    ("sampling", ("argmax", "topk", "sort", "softmax", "sampl")),
)


def kernel_kind(name: str) -> str:
    n = name.lower()
    if n.startswith("triton_"):  # inductor's fusions, named after their ops (`_to_copy`, `mean`, ...)
        return "norm/rope/act/other"
    return next((kind for kind, keys in KERNEL_KINDS if any(k in n for k in keys)), "norm/rope/act/other")


def kernel_ms(kernels: list[list], per: float) -> dict[str, float]:
    """ms per `per` (steps) of each kind, and "all"."""
    out: dict[str, float] = {}
    for name, us, _ in kernels:
        kind = kernel_kind(name)
        out[kind] = out.get(kind, 0.0) + us / 1e3 / per
    out["all"] = sum(out.values())
    return {k: round(v, 3) for k, v in out.items()}


def profile_rows(recs: list[dict]) -> list[dict]:
    """Per engine: a decode step's kernel ms by kind, and what the steps that took the chunk to
    its first token added over that many decode steps (the prompt's own cost beside decodes)."""
    rows = []
    for rec in recs:
        p = rec.get("profile")
        if not p:
            continue
        decode = kernel_ms(p["decode"]["kernels"], p["decode"]["steps"])
        window = kernel_ms(p["mixed"]["kernels"], 1)
        extra = {k: round(window.get(k, 0.0) - (p["mixed"]["steps"] - 1) * decode.get(k, 0.0), 3)
                 for k in set(window) | set(decode)}  # fmt: skip
        rows.append({"engine": rec["engine"], "batch": p["batch"], "context": p["context"], "chunk": p["chunk"],
                     "decode_wall_ms": round(p["decode"]["wall_ms"] / p["decode"]["steps"], 3), "decode": decode,
                     "mixed_steps": p["mixed"]["steps"], "mixed_wall_ms": p["mixed"]["wall_ms"], "mixed_window": window,
                     "chunk_extra": extra,
                     "top": sorted(p["decode"]["kernels"], key=lambda k: -k[1])[:8]})  # fmt: skip
    return rows


def profile_table(rows: list[dict]) -> str:
    kinds = [k for k, _ in KERNEL_KINDS] + ["norm/rope/act/other", "all"]
    body = []
    for r in rows:
        body.append([r["engine"], "decode step", f"{r['decode_wall_ms']:.2f}", *(f"{r['decode'].get(k, 0.0):.3f}" for k in kinds)])
        body.append([r["engine"], f"the chunk's steps ({r['mixed_steps']}) less decode steps",
                     f"{r['mixed_wall_ms'] - (r['mixed_steps'] - 1) * r['decode_wall_ms']:.2f}",
                     *(f"{r['chunk_extra'].get(k, 0.0):.3f}" for k in kinds)])  # fmt: skip
    return markdown_table(["engine", "what", "wall ms", *(f"{k} ms" for k in kinds)], body)


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["engine"], r["error"], *["-"] * 7])
            continue
        s, st = r["summary"], r["steps"]
        body.append([r["engine"], f"{s['completed']}/{s['requests']}", f"{s['goodput_req_s']:.2f} ({100 * s['slo_attainment']:.0f} %)",
                     f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f}", f"{s['itl_ms']['p50']:.2f} / {s['itl_ms']['p99']:.2f}",
                     f"{st['steps']:,} × {st['mean_ms']:.2f} ms ({st['mean_rows']:.1f} rows)",
                     f"{st['with_first_token']:,} × {st['with_first_token_ms'] or 0:.2f} ms",
                     f"{st['others']:,} × {st['others_ms'] or 0:.2f} ms (median {st['median_others_ms'] or 0:.2f})",
                     f"{s['drain_s']:.2f}"])  # fmt: skip
    return markdown_table(["engine", "ok/sent", "goodput req/s (SLO met)", "TTFT p50 / p99 ms", "mean ITL p50 / p99 ms",
                           "steps (mean rows with a token)", "steps where a prompt got its first token",
                           "other steps", "drain s"], body)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="pdserve,vllm", help="comma-separated: pdserve, vllm (run in this order)")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPE_CONFIGS))
    ap.add_argument("--workload", default="chat", choices=sorted(WORKLOADS))
    ap.add_argument("--rate", type=float, default=24.0, help="Poisson arrivals a second (one GPU's share)")
    ap.add_argument("--duration-s", type=float, default=8.0, help="seconds of arrivals")
    ap.add_argument("--scale", type=float, default=1.0, help="prompt lengths times this (the CPU check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="pdserve's engine's device")
    ap.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES of each engine's process")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=50.0)
    ap.add_argument("--vllm-site", default=None, help="vLLM's site folder (pip --target), alone on its PYTHONPATH")
    ap.add_argument("--vllm-python", default=sys.executable)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per engine, start-up included")
    ap.add_argument("--profile", default=None, metavar="BATCH,CONTEXT,CHUNK",
                    help="after the run: kernels of decode steps at BATCH x CONTEXT, and of one CHUNK-token prompt beside them")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    profile = None
    if args.profile:
        try:
            batch, context, chunk = (int(x) for x in args.profile.split(","))
        except ValueError:
            ap.error(f"--profile: BATCH,CONTEXT,CHUNK (three integers), not {args.profile!r}")
        if min(batch, context, chunk) < 1 or context + 4096 > args.max_model_len:
            ap.error(f"--profile: positive, and CONTEXT + 4096 within --max-model-len ({args.max_model_len})")
        profile = {"batch": batch, "context": context, "chunk": chunk}
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ("pdserve", "vllm") for e in engines):
        ap.error(f"--engines: pdserve and/or vllm, not {args.engines!r}")
    if "vllm" in engines and not args.vllm_site:
        ap.error("--vllm-site: needed to run vLLM's engine (its site folder, pip --target)")
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = write_model(args.out / "model", args.shape, args.max_model_len)
    reqs = build_trace(args.workload, args.rate, args.duration_s, args.seed, args.scale, cfg["vocab_size"])
    trace = {"model": str((args.out / "model").resolve()), "max_model_len": args.max_model_len, "device": args.device,
             "requests": reqs, "warmup_prompts": warmup_prompts(reqs, cfg["vocab_size"], args.seed),
             "profile": profile and {**profile, "vocab": cfg["vocab_size"]}}  # fmt: skip
    slo = Slo(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    recs = []
    for engine in engines:
        python = args.vllm_python if engine == "vllm" else sys.executable
        print(f"engine_replay: {engine}: {len(reqs)} requests at {args.rate:g}/s", file=sys.stderr, flush=True)
        recs.append(run_engine(engine, trace, args.out, python, child_env(engine, args.vllm_site, args.gpu), args.timeout_s))
    rows = summary_rows(recs, reqs, slo)
    profiled = profile_rows(recs)
    (args.out / "engine_replay.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows, "profile": profiled}, indent=1) + "\n")  # fmt: skip
    print(f"{args.shape}, {args.workload} at {args.rate:g} req/s for {args.duration_s:g} s, one engine a process, "
          f"goodput: TTFT <= {args.slo_ttft_ms:g} ms and mean ITL <= {args.slo_itl_ms:g} ms\n")
    print(table(rows))
    if profiled:
        p = profiled[0]
        print(f"\nKernels (ms) at {p['batch']} decodes of {p['context']} tokens, and one {p['chunk']}-token prompt beside them:\n")
        print(profile_table(profiled))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
