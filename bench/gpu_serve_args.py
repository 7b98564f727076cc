"""`bench/gpu_serve.py`'s command line: its flags, and what they come to once a `--profile` and
the device's defaults are applied (shape, workloads, rates, scale, context cap, SLOs). Pure."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_serve_workloads import DEFAULT_RATES, PROFILES, WORKLOADS, parse_rates


def _csv(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/gpu_serve.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="every JSON, log, table and plot goes here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the default model, tiny workloads")
    p.add_argument(
        "--gpus", type=int, default=None, choices=[1, 2, 4],
        help="GPUs each server configuration takes (default: the profile's, else 2)",
    )  # fmt: skip
    p.add_argument("--gpu-ids", type=_csv, default=None, help="which GPUs (default: 0..gpus-1)")
    p.add_argument("--servers", type=_csv, default=None, help="comma-separated subset of the configurations")
    p.add_argument("--vllm-pd", action="store_true", help="also run vllm-serve-1p1d (vLLM's NixlConnector; best effort)")
    p.add_argument(
        "--profile", default=None, choices=sorted(PROFILES),
        help="; ".join(f"{k}: {v.about}" for k, v in PROFILES.items()) + " (flags given beside it win)",
    )  # fmt: skip
    p.add_argument("--shape", default=None, choices=["1b", "8b"], help="the random-weight model's shape (default: 1b)")
    p.add_argument("--model", default=None, help="serve this model directory instead of writing a random one")
    p.add_argument("--model-dir", type=Path, default=None, help="where the random shape's config and tokenizer are written")
    p.add_argument("--workloads", type=_csv, default=None, help=f"of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--rates", action="append", default=[], metavar="[WORKLOAD=]R1,R2,...", help="Poisson rates")
    p.add_argument(
        "--duration-s", type=float, default=None,
        help="seconds of arrivals per run: rate x this requests (default: the profile's, else 4)",
    )
    p.add_argument("--requests", type=int, default=None, help="a fixed number of requests per run instead")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="runs per rate, each with its own prompts; the tables show the median goodput's run, "
                   "with the goodputs' range")
    p.add_argument("--refine", type=int, default=0, metavar="N",
                   help="after a workload's rates, up to N more runs a server, each at the midpoint of the two rates "
                   "around where its SLO attainment first fell under 90 %%: the sustained rate (table.md) is then "
                   "read between closer rates (default: 0)")
    p.add_argument("--scale", type=float, default=None, help="multiply the workloads' lengths (cpu default: 0.05)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO (default: 1000; cpu 3000)")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="mean ITL SLO per request (default: 50; cpu 250)")
    p.add_argument(
        "--also-slo-itl-ms", type=lambda v: [float(x) for x in _csv(v)], default=None, metavar="MS[,MS]",
        help="also judge each run by these mean ITL SLOs (same TTFT SLO); --report-only --slo-itl-ms MS shows them",
    )
    p.add_argument("--stop-below", type=float, default=0.25, help="skip higher rates once SLO attainment is below")
    p.add_argument(
        "--diagnose-below", type=float, default=0.5, metavar="SHARE",
        help="after a run that completed less than this share of its requests (or fell under --stop-below), save "
        "the server's Admin.GetStats, /metrics and py-spy dumps into the run's folder (default: 0.5)",
    )
    p.add_argument(
        "--diagnose-s", type=float, default=120.0, metavar="S",
        help="the most one such look may take, py-spy dumps included (default: 120; 0: no look)",
    )
    p.add_argument(
        "--look-mid-run", action="store_true",
        help="also take that look at each pdserve run halfway through its arrivals, into the run's folder + .mid: "
        "where the time goes under load (each py-spy dump pauses its process a moment: for diagnosis, not figures)",
    )  # fmt: skip
    p.add_argument("--py-spy", default=shutil.which("py-spy"), metavar="PATH", help="py-spy (default: on PATH)")
    p.add_argument("--max-model-len", type=int, default=None, help="context cap of every server (default: 8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests per workload sent before measuring")
    p.add_argument("--request-timeout-s", type=float, default=30.0, help="deadline of each request (default: 30)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument(
        "--budget-s", type=float, default=None,
        help="end within this many seconds: start a server, a run or the engine phase only where its worst case "
        "fits (e.g. 540 under a 600-s limit); --dry-run then also says how to split the plan into such calls",
    )
    p.add_argument("--engine-steps", action="store_true", help="only time the engine at the batches OUT's runs show")
    p.add_argument("--no-engine-steps", action="store_true", help="do not time the engine after the servers")
    p.add_argument("--vllm-site", default=None, help="vLLM's site folder (pip --target): its PYTHONPATH, alone")
    p.add_argument("--vllm-python", default=sys.executable, help="the interpreter for vLLM (default: this one)")
    p.add_argument("--pdserve-site", default=None, help="pdserve's site folder, put on pdserve's PYTHONPATH")
    p.add_argument("--pdserve-args", default="", help="extra `pdserve serve` flags, one string")
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="define a pdserve variant: `--servers pdserve-1p1d,pdserve-1p1d+NAME` runs both, the second "
        "with FLAGS added (e.g. --variant eager=--no-prefill-cuda-graphs); repeatable",
    )
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, one string")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time; start nothing")
    p.add_argument("--report-only", action="store_true", help="rebuild the tables and plot from --out")
    return p


def with_profile(args: argparse.Namespace) -> argparse.Namespace:
    """args with --gpus, --servers and --duration-s taken from --profile where not given (--gpus:
    2 without one; --duration-s: 4). ValueError where --gpus contradicts a profile made for
    another count."""
    profile = PROFILES[args.profile] if args.profile else None
    if args.duration_s is None:
        args.duration_s = (profile.duration_s if profile else None) or 4.0
    if args.gpus is None:
        args.gpus = (profile.gpus if profile else None) or 2
    if profile and profile.gpus and args.gpus != profile.gpus:
        raise ValueError(f"--gpus {args.gpus}: profile {args.profile} is for {profile.gpus} GPUs")
    if args.servers is None and profile and profile.servers:
        args.servers = list(profile.servers)
    return args


@dataclass(frozen=True)
class Choice:
    """What one invocation sends and judges by."""

    shape: str
    workloads: tuple[str, ...]
    rates: dict[str, tuple[float, ...]]
    scale: float
    max_len: int
    slo_ttft_ms: float
    slo_itl_ms: float
    also_itl_ms: tuple[float, ...] = ()


def resolve(args: argparse.Namespace) -> Choice:
    """The flags with --profile and the device's defaults applied; flags given win over the
    profile. ValueError (its message a sentence for the user) on a contradiction."""
    cpu = args.device == "cpu"
    profile = PROFILES[args.profile] if args.profile else None
    shape = args.shape or (profile.shape if profile else "1b")
    workloads = tuple(args.workloads or (profile.rates if profile else WORKLOADS))
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: {args.repeats}; at least 1 run per rate")
    if args.refine < 0:
        raise ValueError(f"--refine: {args.refine}; a number of runs, 0 or more")
    scale = args.scale if args.scale is not None else (0.05 if cpu else 1.0)
    per_gpus = 1.0 if cpu else args.gpus / 2  # the rates are for 2 GPUs: 1 serves about half the load, 4 twice
    # On a CPU a profile picks the workloads only: its GPU rates and SLOs would leave nothing to compare.
    base = DEFAULT_RATES["cpu" if cpu else shape] | ({} if cpu or profile is None else profile.rates)
    rates = parse_rates(args.rates, workloads, {w: tuple(r * per_gpus for r in rs) for w, rs in base.items()})
    max_len = args.max_model_len or (1024 if cpu else 8192)  # cpu: a KV pool sized for short requests
    need = max(WORKLOADS[w].max_len(scale) for w in workloads)
    if need > max_len:
        raise ValueError(f"--max-model-len {max_len} is below the longest request ({need} tokens)")
    if args.gpu_ids and len(args.gpu_ids) < args.gpus:
        raise ValueError(f"--gpu-ids: {len(args.gpu_ids)} given for --gpus {args.gpus}")
    # A CPU decodes the default model at ~100 ms a token: the GPU SLOs would leave no goodput to compare.
    ttft = args.slo_ttft_ms or (3000.0 if cpu else profile.slo_ttft_ms if profile else 1000.0)
    itl = args.slo_itl_ms or (250.0 if cpu else profile.slo_itl_ms if profile else 50.0)
    also = args.also_slo_itl_ms if args.also_slo_itl_ms is not None else (profile.also_itl_ms if profile else ())
    return Choice(shape, workloads, rates, scale, max_len, ttft, itl, tuple(a for a in also if a != itl))


def model_dir(args: argparse.Namespace, shape: str) -> tuple[str, dict]:
    """The model directory: --model, the default model on CPU, or a random shape's config and
    tokenizer alone, in a folder of their own; every server and the engine-step child then draw
    random weights (--load-format dummy)."""
    if args.model:
        return args.model, {"dir": args.model}
    if args.device == "cpu":
        from pdserve.models.resolve import resolve_model

        path = str(resolve_model(None))
        return path, {"dir": path, "default": True}
    from bench.random_model import shape_config, write_tokenizer

    cache = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
    target = args.model_dir or cache / "bench-models" / f"llama-{shape}-random-config"
    if args.dry_run:
        return str(target), {"dir": str(target)}
    cfg = shape_config(shape)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer(target, cfg["vocab_size"], cfg.get("bos_token_id"), cfg.get("eos_token_id"))
    return str(target), {"dir": str(target), "weights": False}
