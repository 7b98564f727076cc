#!/usr/bin/env python3
"""CPU decode (and mixed) step time, this checkout beside a baseline revision, interleaved in one run.

The default model decodes a batch of random prompts (greedy) in one engine per code tree, each in
its own process, for --rounds rounds of --steps steps in ABBA order; the table gives each tree's
step p10/p50/p90, and the generated tokens must match. --profile adds top-level ops and profiled
time; --mixed N times mixed steps (an N-token prompt beside the decodes); --stub-matmuls times
what is left without the matmuls (its tokens are not compared).
    python bench/cpu_decode_step.py --baseline HEAD~1 [--batch 4] [--threads 1] [--rounds 12] [--steps 8] [--profile]
    python bench/cpu_decode_step.py --baseline HEAD~1 --mixed 64 --rounds 8 --steps 2
    python bench/cpu_decode_step.py            # this checkout alone
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import cpu_name, markdown_table, write_json

MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm")


@dataclass(frozen=True)
class Workload:
    batch: int
    threads: int
    prompt_len: int  # median prompt length; each prompt is drawn within +-50 % of it
    warmup: int
    max_tokens: int
    seed: int = 0
    mixed: int = 0  # > 0: time mixed steps, each prefilling a new prompt of this many tokens
    stub_matmuls: bool = False


# ----- worker: one engine over one code tree ----------------------------------------------------


def _worker(tree: Path, w: Workload) -> None:
    sys.path.insert(0, str(tree))
    for name in [m for m in sys.modules if m == "pdserve" or m.startswith("pdserve.")]:
        del sys.modules[name]
    import torch

    from pdserve import LLM, SamplingParams

    torch.set_num_threads(w.threads)
    llm = LLM(None, device="cpu")
    engine = llm.engine
    if w.stub_matmuls:
        _stub_matmuls()
    rng = random.Random(w.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True)
    lens = [max(1, round(w.prompt_len * rng.uniform(0.5, 1.5))) for _ in range(w.batch)]
    ids = [engine.add_request([rng.randrange(10, vocab) for _ in range(n)], params) for n in lens]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> int:
        outs = engine.step()
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
        return len(outs)

    while any(not t for t in tokens.values()):
        step()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed_step(around: Callable[[], AbstractContextManager[Any]] = nullcontext) -> float:
        """A step as the workload times it (inside `around`); the mixed workload's untimed
        decode step after."""
        if w.mixed:
            newcomer = engine.add_request([rng.randrange(10, vocab) for _ in range(w.mixed)], one)
            tokens[newcomer] = []
        with around():
            t0 = time.perf_counter()
            n = step()
            took = time.perf_counter() - t0
        assert n == w.batch + (w.mixed > 0), f"expected a step of {w.batch} sequences, got {n} outputs"
        if w.mixed:
            assert len(tokens[newcomer]) == 1 and step() == w.batch, "the new request was not prefilled in one step"
        return took

    for _ in range(w.warmup):
        timed_step()
    _reply({"ready": True, "pdserve": str(Path(sys.modules["pdserve"].__file__).parent), "threads": torch.get_num_threads()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "steps":
            _reply({"times": [timed_step() for _ in range(cmd["n"])]})
        elif cmd["cmd"] == "profile":
            _reply(_profile(timed_step, cmd["n"]))
        elif cmd["cmd"] == "tokens":
            _reply({"tokens": list(tokens.values())})  # the batch, then any mixed steps' newcomers
        else:
            return


def _stub_matmuls() -> None:
    """Every `PackedLinear` (the CPU engine's matmuls) returns a kept tensor of its output shape."""
    import torch

    from pdserve.engine.model.cpu_linear import PackedLinear

    kept: dict[tuple[int, int], torch.Tensor] = {}

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.out_features)
        if shape not in kept:
            kept[shape] = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * 0.02
        return kept[shape]

    PackedLinear.forward = forward


def _profile(timed_step: Any, n: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    top = []
    for _ in range(n):
        # A profiler per timed step: the mixed workload's untimed steps stay out of it.
        prof = profile(activities=[ProfilerActivity.CPU])
        timed_step(lambda p=prof: p)
        top += [e for e in prof.events() if e.cpu_parent is None]
    matmul_us = sum(e.cpu_time_total for e in top if e.name in MATMUL_OPS)
    other_us = sum(e.cpu_time_total for e in top if e.name not in MATMUL_OPS)
    by_name: dict[str, list[float]] = {}
    for e in top:
        c = by_name.setdefault(e.name, [0, 0.0])
        c[0] += 1
        c[1] += e.cpu_time_total
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "ops_per_step": len(top) / n,
        "matmul_ms": matmul_us / n / 1e3,
        "other_ops_ms": other_us / n / 1e3,
        "heaviest": [(k, c / n, t / n / 1e3) for k, (c, t) in heaviest],
    }


def _reply(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


# ----- parent: interleave the trees -------------------------------------------------------------


class Worker:
    def __init__(self, label: str, tree: Path, w: Workload) -> None:
        self.label = label
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--batch", str(w.batch),
            "--threads", str(w.threads), "--prompt-len", str(w.prompt_len), "--warmup", str(w.warmup),
            "--max-tokens", str(w.max_tokens), "--mixed", str(w.mixed),
            *(["--stub-matmuls"] if w.stub_matmuls else []),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(w.threads)}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
        self.ready = self._read()
        self.times: list[float] = []

    def ask(self, **cmd: Any) -> dict[str, Any]:
        stdin: TextIO = self.proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(cmd) + "\n")
        stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        stdout: TextIO = self.proc.stdout  # type: ignore[assignment]
        for line in stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.label}: worker exited ({self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(cmd="quit")
            except (RuntimeError, BrokenPipeError):
                pass
            self.proc.wait(timeout=30)


def export_tree(rev: str, into: Path) -> Path:
    """The committed tree of `rev` (no working-tree changes) extracted under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True, capture_output=True).stdout
    dest = into / "baseline"
    dest.mkdir()
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")
    return dest


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    w = Workload(
        batch=args.batch, threads=args.threads, prompt_len=args.prompt_len, warmup=args.warmup,
        max_tokens=(2 if args.mixed else 1) * (args.warmup + args.rounds * args.steps + args.profile_steps) + 64,
        mixed=args.mixed,
        stub_matmuls=args.stub_matmuls,
    )
    loadavg_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cpu-step-") as tmp:
        trees: list[tuple[str, Path]] = []
        if args.baseline:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], check=True, capture_output=True, text=True).stdout.strip()
            trees.append((f"baseline {rev}", export_tree(args.baseline, Path(tmp))))
        trees.append(("this checkout", ROOT))
        workers = [Worker(label, tree, w) for label, tree in trees]
        try:
            for r in range(args.rounds):
                order = workers if r % 2 == 0 else workers[::-1]
                for wk in order:
                    wk.times.extend(wk.ask(cmd="steps", n=args.steps)["times"])
            profiles = [wk.ask(cmd="profile", n=args.profile_steps) if args.profile_steps else None for wk in workers]
            tokens = [wk.ask(cmd="tokens")["tokens"] for wk in workers]
        finally:
            for wk in workers:
                wk.close()
    rows = []
    for wk, prof in zip(workers, profiles):
        p50 = statistics.median(wk.times)
        rows.append({
            "code": wk.label, "step_ms_p50": p50 * 1e3, "step_ms_p10": _pct(wk.times, 0.1) * 1e3,
            "step_ms_p90": _pct(wk.times, 0.9) * 1e3, "tok_s": args.batch / p50, "steps": len(wk.times), "profile": prof,
        })
    return {
        "workload": w.__dict__, "rounds": args.rounds, "steps_per_round": args.steps, "cpu": cpu_name(),
        "cores": os.cpu_count(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
        "tokens_identical": None if w.stub_matmuls else all(t == tokens[0] for t in tokens), "rows": rows,
    }


def format_report(rep: dict[str, Any]) -> str:
    head = ["code", "step ms p50", "p10", "p90", "tok/s"]
    profiled = any(r["profile"] for r in rep["rows"])
    if profiled:
        head += ["ops/step", "matmul ms (prof.)", "other ops ms (prof.)"]
    body = []
    for r in rep["rows"]:
        cells = [r["code"], f"{r['step_ms_p50']:.1f}", f"{r['step_ms_p10']:.1f}", f"{r['step_ms_p90']:.1f}", f"{r['tok_s']:.1f}"]
        if profiled:
            p = r["profile"]
            cells += [f"{p['ops_per_step']:.0f}", f"{p['matmul_ms']:.1f}", f"{p['other_ops_ms']:.1f}"]
        body.append(cells)
    w = rep["workload"]
    what = f"mixed steps (a {w['mixed']}-token prompt beside the decodes)" if w.get("mixed") else "decode steps"
    lines = [
        (
            f"{rep['cpu']}, {rep['cores']} cores, {w['threads']} torch thread(s); {what}; batch {w['batch']}, prompts ~{w['prompt_len']} tokens; "
            f"{rep['rounds']} rounds x {rep['steps_per_round']} steps per code tree; "
            f"load average {rep['loadavg_start'][0]:.2f} -> {rep['loadavg_end'][0]:.2f}"
        ),
        "",
        markdown_table(head, body),
        "",
        "generated tokens identical across trees: "
        + {True: "yes", False: "NO", None: "not compared (matmuls stubbed)"}[rep["tokens_identical"]],
    ]
    if profiled:
        for r in rep["rows"]:
            heavy = ", ".join(f"{name} {n:.0f}x {ms:.2f} ms" for name, n, ms in r["profile"]["heaviest"])
            lines.append(f"{r['code']} heaviest ops a step: {heavy}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="git revision to time beside this checkout (its committed tree)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (a decode worker of `pdserve serve` on 2 cores gets 1)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8, help="steps per tree per round")
    ap.add_argument("--mixed", type=int, default=0, metavar="N", help="time mixed steps: each prefills a new N-token prompt beside the decodes")
    ap.add_argument("--stub-matmuls", action="store_true", help="time the step without its matmuls (tokens not compared)")
    ap.add_argument("--profile", dest="profile_steps", type=int, nargs="?", const=5, default=0, help="profile N steps (default 5) per tree")
    ap.add_argument("--json", help="write the report as JSON to this path ('-': stdout)")
    ap.add_argument("--max-tokens", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        _worker(args.worker, Workload(
                args.batch, args.threads, args.prompt_len, args.warmup, args.max_tokens, mixed=args.mixed,
                stub_matmuls=args.stub_matmuls,
            ))
        return
    rep = run(args)
    print(format_report(rep))
    if args.json:
        write_json(args.json, json.dumps(rep, indent=2))


if __name__ == "__main__":
    main()
