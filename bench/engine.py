#!/usr/bin/env python3
"""Engine micro-benchmark: decode step time and prefill throughput beside their floors.

GPU: 1B- and 8B-shaped models with random bf16 weights, CUDA graphs on. Decode at batch 1, 32 and
128 (context ~512): 30 ``engine.step()`` calls over one synchronization, per step, against (weight
+ KV bytes) / the copy bandwidth measured in the same run (target: batch 1 within 1.5x). Prefill
of one 4096-token prompt as % of the same run's bf16 matmul rate (target: >= 50 %). CPU: the
default model at batch 1 and 8, decode and end-to-end tokens/s. docs/benchmarks.md, "Engine".

    python bench/engine.py --device cuda [--shapes 1b,8b] [--json out.json] [--profile [1,32]]
    python bench/engine.py --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import add_json_option, cpu_name, markdown_table, write_json
from pdserve import LLM, SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    "1b": {  # Llama-3.2-1B
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",  # transformers (a tokenizer load, vLLM) reads the config by it
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "8b": {  # Llama-3-8B (3.1 rope scaling)
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",  # transformers (a tokenizer load, vLLM) reads the config by it
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
}

DECODE_BATCHES = (1, 32, 128)
DECODE_CONTEXT = 512
PREFILL_TOKENS = 4096
MAX_MODEL_LEN = 8192
BLOCK_SIZE = 16


@dataclass
class Row:
    shape: str
    metric: str
    value: float
    unit: str
    floor: float | None = None  # same unit as value
    ratio: str = ""  # e.g. "1.23x floor" or "61 % of matmul"
    target: str = ""
    met: bool | None = None
    extra: dict[str, Any] | None = None


# ----- model arithmetic ---------------------------------------------------------------------


def weight_bytes_per_decode_step(c: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Bytes of weights a decode step reads: every layer, the final norm, the LM head (the
    embedding table when tied). An untied embedding lookup reads only a few rows: not counted."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    hq, hkv, v = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i + 2 * h
    return (c["num_hidden_layers"] * per_layer + h + v * h) * dtype_bytes


def kv_bytes_per_token(c: dict[str, Any], dtype_bytes: int = 2) -> int:
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def prefill_flops(c: dict[str, Any], t: int) -> float:
    """Matmul FLOPs of a t-token causal prefill from an empty cache; logits for the last token only."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    hq, hkv, v, n = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"], c["num_hidden_layers"]
    linear = 2 * t * n * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    attention = n * 2 * 2 * hq * d * (t * (t + 1) / 2)  # QK^T and PV over the causal triangle
    return linear + attention + 2 * h * v


# ----- same-run ceilings ----------------------------------------------------------------------


def _time_cuda(fn, reps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = statistics.median(_time_cuda(lambda: dst.copy_(src), reps))
    return 2 * nbytes / t


def matmul_rate(n: int = 8192, reps: int = 20) -> float:
    """bf16 matmul FLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = statistics.median(_time_cuda(lambda: torch.matmul(a, b), reps))
    return 2 * n**3 / t


# ----- engine drivers -------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def decode_steps(
    llm: LLM, batch: int, context: int, warmup: int, reps: int, rng: random.Random, device: str
) -> tuple[list[float], float, float]:
    """Times engine.step() once every sequence is decoding. Returns (each step's time, synchronized
    before and after it; the steady-state step time, `reps` steps back to back over one
    synchronization, which is what a serving loop sees when step n+1 overlaps step n's host
    work; the mean context)."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    # Far more tokens than the timed steps need (sequences that finished prefill first are
    # already a few tokens ahead); the rest are aborted at the end.
    params = SamplingParams(max_tokens=warmup + 2 * reps + 256, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(_random_prompt(rng, context, vocab), params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked, mixed with the first decodes)
        for out in engine.step():
            started.add(out.request_id)
    for _ in range(warmup):
        engine.step()
    times, contexts = [], []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        outs = engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch, f"expected a pure decode step of {batch}, got {len(outs)} outputs"
        contexts.append(statistics.mean(len(o.prompt_token_ids) + len(o.token_ids) for o in outs))
    _sync(device)
    t0 = time.perf_counter()
    produced = sum(len(engine.step()) for _ in range(reps))
    _sync(device)
    steady = (time.perf_counter() - t0) / reps
    assert produced == batch * reps, f"expected {batch * reps} tokens from {reps} decode steps, got {produced}"
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():  # a step launched ahead is still on the device: let it land
        engine.step()
    return times, steady, statistics.mean(contexts)


def graph_replay_time(llm: LLM, batch: int, reps: int = 20) -> float | None:
    """GPU time of the captured decode forward alone (diagnostic: no host work, no sampling).
    Replays the graph holding the last step's inputs; it rewrites the same KV slots."""
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    return statistics.median(_time_cuda(graphs.graphs[graphs.size_for(batch)].replay, reps))


def prefill_time(llm: LLM, tokens: int, warmup: int, reps: int, rng: random.Random, device: str) -> list[float]:
    """Wall time of the engine step that prefills one fresh `tokens`-long prompt (and samples),
    to its token on the host. An overlapped engine (CUDA graphs) launches that step and hands its
    token back with the next call, which then has nothing else to launch: both calls are timed."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    times = []
    for i in range(warmup + reps):
        rid = engine.add_request(_random_prompt(rng, tokens, vocab), SamplingParams(max_tokens=1, temperature=0.0))
        _sync(device)
        t0 = time.perf_counter()
        outs = engine.step()
        if not outs:
            outs = engine.step()  # the launched step's token; nothing follows a finished request
        _sync(device)
        dt = time.perf_counter() - t0
        assert [o.request_id for o in outs] == [rid] and outs[0].finished, "prefill did not finish in one step"
        engine.release(rid)
        if i >= warmup:
            times.append(dt)
    return times


def _kernel_category(name: str) -> str:
    n = name.lower()
    if "flash" in n:
        return "attention"
    if "nvjet" in n or "gemm" in n or "xmma" in n or "cutlass" in n:
        return "matmul"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "elementwise/other"


def _kernel_breakdown(prof, per: int, label: str, wall_s: float, top: int) -> str:
    from torch.autograd import DeviceType

    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels)
    count = sum(e.count for e in kernels)
    cats: dict[str, list[float]] = {}
    for e in kernels:
        c = cats.setdefault(_kernel_category(e.key), [0.0, 0.0])
        c[0] += e.self_device_time_total
        c[1] += e.count
    head = (
        f"{label}: wall {wall_s / per * 1e3:.3f} ms, GPU kernel time {total / per / 1e3:.3f} ms, "
        f"{count / per:.0f} kernels (per step)"
    )
    lines = [head]
    for name, (t, n) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {name:18s} {t / per / 1e3:7.3f} ms  {n / per:5.0f} kernels")
    lines.append("  top kernels:")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        lines.append(f"  {e.self_device_time_total / per / 1e3:7.3f} ms  {e.count / per:5.0f}x  {e.key[:90]}")
    return "\n".join(lines)


def profile_steps(llm: LLM, batch: int, rng: random.Random, top: int = 10, prefill: bool = True) -> str:
    """Kernel-level breakdown of a few decode steps (graphs replayed) and, with `prefill`, of
    one 4k prefill. Kernels launched as programmatic dependents overlap their predecessors,
    and the profiler counts the overlap in each: at batch 1 (Triton decode kernels) their
    times add up to more than the step takes."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    ids = [
        engine.add_request(
            _random_prompt(rng, DECODE_CONTEXT, vocab), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        )
        for _ in range(batch)
    ]
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            started.add(out.request_id)
    for _ in range(3):
        engine.step()
    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():  # a decode step launched ahead is still on the device: let it land
        engine.step()
    out = [_kernel_breakdown(prof, steps, f"decode batch {batch}", wall, top)]
    if not prefill:
        return "\n".join(out)
    rid = engine.add_request(_random_prompt(rng, PREFILL_TOKENS, vocab), SamplingParams(max_tokens=1, temperature=0.0))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        outs = engine.step()
        if not outs:  # an overlapped engine launched the step; its token comes with the next call
            outs = engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    assert [o.request_id for o in outs] == [rid], "the profiled step was not the prefill"
    engine.release(rid)
    out.append(_kernel_breakdown(prof, 1, f"prefill {PREFILL_TOKENS} (under the profiler)", wall, top))
    return "\n".join(out)


def _free(llm: LLM | None) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----- GPU benchmark --------------------------------------------------------------------------


def bench_gpu(args: argparse.Namespace, bar) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    info: dict[str, Any] = {"card": torch.cuda.get_device_name(0)}
    info["elementwise"] = "eager" if args.eager else "compiled (torch.compile)"
    info["triton_decode_kernels"] = args.triton_decode  # as asked; None: the engine's default
    bar.set_description("copy bandwidth")
    bw = copy_bandwidth()
    bar.update(1)
    bar.set_description("matmul rate")
    mm = matmul_rate()
    bar.update(1)
    info["copy_bandwidth_GBps"] = bw / 1e9
    info["matmul_TFLOPs"] = mm / 1e12
    rows.append(Row("-", "device copy bandwidth (read+write)", bw / 1e9, "GB/s"))
    rows.append(Row("-", "bf16 matmul 8192^3", mm / 1e12, "TFLOP/s"))
    profiles: dict[str, str] = {}
    rng = random.Random(0)
    for shape in args.shapes:
        cfg = SHAPES[shape]
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(cfg))
            max_b = max(DECODE_BATCHES)
            per_seq = -(-(DECODE_CONTEXT + args.decode_warmup + args.decode_reps + 16) // BLOCK_SIZE)
            num_blocks = 2 * max(max_b * per_seq, -(-PREFILL_TOKENS // BLOCK_SIZE) * 2) + 64
            bar.set_description(f"{shape}: load + capture")
            llm = LLM(
                tmp,
                device="cuda",
                dtype="bfloat16",
                load_format="dummy",
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=max_b,
                max_num_batched_tokens=max(PREFILL_TOKENS, 8192),
                num_kv_blocks=num_blocks,
                block_size=BLOCK_SIZE,
                cuda_graph_max_batch=max_b,
                enable_prefix_caching=False,
                compile_elementwise=not args.eager,
                overlap_decode=not args.no_overlap,
                triton_decode_kernels=args.triton_decode,
            )
            backend = llm.engine.runner.backend.name
            info[f"{shape}_attention_backend"] = backend
            info[f"{shape}_cuda_graphs"] = sorted(llm.engine.runner.graphs.graphs) if llm.engine.runner.graphs else []
            info[f"{shape}_decode_kernel_graphs"] = llm.engine.runner.decode_kernel_graphs
            bar.update(1)
            wbytes = weight_bytes_per_decode_step(cfg)
            for b in DECODE_BATCHES:
                bar.set_description(f"{shape}: decode batch {b}")
                times, step, ctx = decode_steps(llm, b, DECODE_CONTEXT, args.decode_warmup, args.decode_reps, rng, "cuda")
                fwd = graph_replay_time(llm, b)
                kv = b * ctx * kv_bytes_per_token(cfg)
                floor = (wbytes + kv) / bw
                met = step <= 1.5 * floor if b == 1 else None
                rows.append(
                    Row(
                        shape,
                        f"decode step, batch {b}, ctx ~{ctx:.0f}",
                        step * 1e3,
                        "ms",
                        floor * 1e3,
                        f"{step / floor:.2f}x floor",
                        "<= 1.5x floor" if b == 1 else "",
                        met,
                        {
                            "tokens_per_s": b / step,
                            "graph_forward_ms": None if fwd is None else fwd * 1e3,
                            "weight_GB": wbytes / 1e9,
                            "kv_read_GB": kv / 1e9,
                            "synced_step_median_ms": statistics.median(times) * 1e3,
                            "synced_step_p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
                        },
                    )
                )
                bar.update(1)
            bar.set_description(f"{shape}: prefill {PREFILL_TOKENS}")
            ptimes = prefill_time(llm, PREFILL_TOKENS, args.prefill_warmup, args.prefill_reps, rng, "cuda")
            pt = statistics.median(ptimes)
            flops = prefill_flops(cfg, PREFILL_TOKENS)
            pfloor = flops / mm
            rows.append(
                Row(
                    shape,
                    f"prefill {PREFILL_TOKENS} tokens",
                    PREFILL_TOKENS / pt,
                    "tok/s",
                    PREFILL_TOKENS / pfloor,
                    f"{100 * pfloor / pt:.0f} % of matmul ({flops / pt / 1e12:.0f} TFLOP/s)",
                    ">= 50 % of matmul",
                    pfloor / pt >= 0.5,
                    {"time_ms": pt * 1e3, "tflops": flops / 1e12},
                )
            )
            bar.update(1)
            if args.profile:
                bar.set_description(f"{shape}: profile")
                try:
                    profiles[shape] = "\n".join(
                        profile_steps(llm, b, rng, prefill=i == 0) for i, b in enumerate(args.profile)
                    )
                except Exception as exc:  # noqa: BLE001 - a diagnostic must not lose the numbers
                    profiles[shape] = f"profiling failed: {type(exc).__name__}: {exc}"
            _free(llm)
            llm = None
    info["profiles"] = profiles
    return rows, info


# ----- CPU benchmark --------------------------------------------------------------------------


def bench_cpu(args: argparse.Namespace, bar) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    bar.set_description("default model: load")
    llm = LLM(None, device="cpu")  # SmolLM2-135M, float32, torch SDPA
    info: dict[str, Any] = {
        "model": str(llm.engine.cfg.model),
        "dtype": str(llm.engine.cfg.dtype),
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),  # other work on the machine skews CPU timings
    }
    bar.update(1)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    ctx, new = 128, 64
    for b in (1, 8):
        bar.set_description(f"cpu: decode batch {b}")
        times, _, mean_ctx = decode_steps(llm, b, ctx, 3, args.cpu_reps, rng, "cpu")
        step = statistics.median(times)
        rows.append(
            Row(
                "smollm2-135m",
                f"decode step, batch {b}, ctx ~{mean_ctx:.0f}",
                b / step,
                "tok/s",
                extra={"step_ms": step * 1e3},
            )
        )
        bar.update(1)
        bar.set_description(f"cpu: generate batch {b}")
        prompts = [_random_prompt(rng, ctx, vocab) for _ in range(b)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        dt = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        rows.append(
            Row(
                "smollm2-135m",
                f"generate end-to-end, batch {b}, {ctx}-token prompts, {new} new",
                n / dt,
                "tok/s",
                extra={"wall_s": dt},
            )
        )
        bar.update(1)
    info["loadavg_at_end"] = os.getloadavg()
    return rows, info


# ----- output ---------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    head = ["shape", "metric", "measured", "floor", "vs floor", "target", "met"]
    body = []
    for r in rows:
        body.append(
            [
                r.shape,
                r.metric,
                f"{r.value:,.3f} {r.unit}" if r.value < 100 else f"{r.value:,.0f} {r.unit}",
                ""
                if r.floor is None
                else (f"{r.floor:,.3f} {r.unit}" if r.floor < 100 else f"{r.floor:,.0f} {r.unit}"),
                r.ratio,
                r.target,
                "" if r.met is None else ("yes" if r.met else "NO"),
            ]
        )
    return markdown_table(head, body)


def write_perf_model(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from bench.perf_model import measure

    with tempfile.TemporaryDirectory() as tmp, tqdm(file=sys.stderr, dynamic_ncols=True) as bar:
        if args.device == "cuda":
            shape = args.shapes[0]
            (Path(tmp) / "config.json").write_text(json.dumps(SHAPES[shape]))
            llm = LLM(
                tmp, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=max(PREFILL_TOKENS, 8192), max_num_seqs=256,  # each measured step whole
            )
            name = f"{shape}-{torch.cuda.get_device_name().split()[1].lower()}"
        else:
            llm, name = LLM(None, device="cpu"), "smollm2-135m-cpu"
        model = measure(llm, name, args.device, reps=5 if args.device == "cuda" else 7, bar=bar)
    Path(args.perf_model).write_text(model.to_json())
    print(model.to_json())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated subset of: " + ",".join(SHAPES))
    add_json_option(ap)
    ap.add_argument(
        "--profile",
        nargs="?",
        const="1",
        type=lambda v: [int(b) for b in v.split(",")],
        metavar="BATCHES",
        help="GPU: print a kernel breakdown of decode steps at these batch sizes (default 1; e.g. 1,32) and of a prefill",
    )
    ap.add_argument(
        "--eager",
        action="store_true",
        help="GPU: keep the model's norm/RoPE/SiLU chains eager instead of torch.compile'd (what fusion buys)",
    )
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="GPU: read each decode step's tokens back before launching the next (what overlap buys)",
    )
    ap.add_argument(
        "--triton-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GPU: decode graphs through pdserve's Triton decode kernels (engine option triton_decode_kernels; "
        "default: the engine's, on wherever Triton imports). --no-triton-decode: cuBLAS and flash-attn",
    )
    ap.add_argument("--decode-warmup", type=int, default=5)
    ap.add_argument("--decode-reps", type=int, default=30)
    ap.add_argument("--prefill-warmup", type=int, default=2)
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--cpu-reps", type=int, default=15)
    ap.add_argument(
        "--perf-model", default=None, metavar="PATH",
        help="instead: measure the controller simulator's performance model (prefill vs tokens, decode step vs "
        "batch and context; the first of --shapes on cuda, the default model on cpu) and write it to PATH as JSON",
    )
    args = ap.parse_args()
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    from tqdm import tqdm

    if args.perf_model:
        write_perf_model(args)
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: CUDA is not available")
        total = 2 + len(args.shapes) * (2 + len(DECODE_BATCHES))
    else:
        total = 5
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with tqdm(total=total, file=sys.stderr, dynamic_ncols=True) as bar:
        rows, info = bench_gpu(args, bar) if args.device == "cuda" else bench_cpu(args, bar)
    info.update(
        {
            "date": started,
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "torch": torch.__version__,
        }
    )
    print()
    for k, v in info.items():
        if k != "profiles":
            print(f"{k}: {v}")
    print()
    print(format_table(rows))
    for shape, text in info.get("profiles", {}).items():
        print(f"\nprofile {shape}: {text}")
    extras = [r for r in rows if r.extra]
    if extras:
        print()
        for r in extras:
            print(
                f"{r.shape} {r.metric}: "
                + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
            )
    if args.json is not None:
        payload = json.dumps({"info": info, "rows": [r.__dict__ for r in rows]}, indent=2)
        write_json(args.json, payload)


if __name__ == "__main__":
    main()
