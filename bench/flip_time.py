"""Measure the in-place role flip (drain, switch, probe) on a real cluster, under load.

One prefill and one decode worker through Ray, a few streams running, the prefill worker flipped
to decode and back --flips times; phases from the flipper's own `RoleChange`. Baseline in the same
run: stopping the worker and starting a fresh one (`Cluster.remove_worker`, `add_worker`).
`--perf-model FILE` writes the median flip time into that model's `flip_s`.

    python bench/flip_time.py --device cpu [--flips 4] [--model DIR] [--json out.json]
    python bench/flip_time.py --device cuda --dtype bfloat16 --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from pdserve.cluster.serve import Cluster  # noqa: E402
from pdserve.cluster.serve_config import ServeConfig  # noqa: E402
from pdserve.engine.args import EngineArgs  # noqa: E402
from pdserve_proto import inference_pb2 as pb  # noqa: E402
from pdserve_proto import inference_pb2_grpc as pbg  # noqa: E402


def _load(address: str, stop: threading.Event, errors: list[str]) -> None:
    """One client streaming requests back to back until `stop`: the flip happens under load."""
    with grpc.insecure_channel(address) as ch:
        stub = pbg.InferenceStub(ch)
        i = 0
        while not stop.is_set():
            ids = [100 + (i * 7 + k) % 900 for k in range(64)]
            params = pb.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            try:
                for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params), timeout=120):
                    pass
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
            i += 1


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = ServeConfig(
        model=args.model, device=args.device, dtype=args.dtype, port=0, num_prefill=1, num_decode=1,
        engine=EngineArgs(num_kv_blocks=args.num_kv_blocks) if args.num_kv_blocks else EngineArgs(),
    )
    t = time.monotonic()
    cluster = await Cluster.start(cfg)
    started_s = time.monotonic() - t
    stop, errors = threading.Event(), []
    clients = [threading.Thread(target=_load, args=(cluster.address, stop, errors), daemon=True) for _ in range(args.streams)]
    changes = []
    try:
        for c in clients:
            c.start()
        await asyncio.sleep(args.warmup_s)
        for _ in range(args.flips):
            for role in ("decode", "prefill"):
                change = await cluster.flipper.change("prefill-0", role, drain_timeout_s=args.drain_timeout_s)
                if not change.ok:
                    raise RuntimeError(f"flip failed: {change.error}")
                changes.append(change)
                await asyncio.sleep(args.pause_s)
        _print_flips(changes)  # before the baseline, which may fail on its own
        # The baseline: what moving a worker costs without the flip, stopping it and starting a
        # new one in its place (model load and links included). On a GPU machine it takes the
        # stopped worker's GPU.
        await cluster.remove_worker("prefill-0")
        t = time.monotonic()
        await cluster.add_worker("prefill")
        add_s = time.monotonic() - t
    finally:
        stop.set()
        for c in clients:
            await asyncio.to_thread(c.join, 150)
        await cluster.stop()
    return {"device": _device_name(args.device), "start_s": started_s, "add_worker_s": add_s, "errors": errors,
            "flips": [{"to": c.to_role, "drain_s": c.drain_s, "switch_s": c.switch_s, "probe_s": c.probe_s,
                       "streams_moved": c.streams_moved} for c in changes]}


def _print_flips(changes: list[Any]) -> None:
    for c in changes:
        print(f"flip {c.from_role}->{c.to_role}: drain {c.drain_s:.3f} s, switch {c.switch_s:.3f} s, "
              f"probe {c.probe_s:.3f} s, {c.streams_moved} streams moved", flush=True)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cuda"
    import os

    return f"cpu ({os.cpu_count()} cores)"


def table(result: dict[str, Any]) -> str:
    rows = ["| flip | n | drain s | switch s | probe s | total s |", "|---|---|---|---|---|---|"]
    for to in ("decode", "prefill"):
        fs = [f for f in result["flips"] if f["to"] == to]
        if not fs:
            continue
        med = {k: statistics.median(f[k] for f in fs) for k in ("drain_s", "switch_s", "probe_s")}
        total = statistics.median(f["drain_s"] + f["switch_s"] + f["probe_s"] for f in fs)
        src = "prefill" if to == "decode" else "decode"
        rows.append(f"| {src} -> {to} | {len(fs)} | {med['drain_s']:.3f} | {med['switch_s']:.3f} | "
                    f"{med['probe_s']:.3f} | {total:.3f} |")
    rows.append(f"| baseline: a fresh worker in its place (model load, links) | 1 | | | | {result['add_worker_s']:.3f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded default model)")
    ap.add_argument("--flips", type=int, default=3, help="round trips prefill -> decode -> prefill")
    ap.add_argument("--streams", type=int, default=2, help="clients streaming during the flips")
    ap.add_argument("--drain-timeout-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--pause-s", type=float, default=1.0, help="between flips")
    ap.add_argument("--num-kv-blocks", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the raw result here")
    ap.add_argument("--perf-model", type=Path, default=None, help="set this performance model's flip_s to the median")
    args = ap.parse_args()
    result = asyncio.run(_run(args))
    print(f"{result['device']}: cluster start {result['start_s']:.1f} s, {len(result['errors'])} failed requests")
    print(table(result))
    for e in result["errors"][:5]:
        print("error:", e)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.perf_model:
        flip_s = statistics.median(f["drain_s"] + f["switch_s"] + f["probe_s"] for f in result["flips"])
        model = json.loads(args.perf_model.read_text())
        model["flip_s"] = round(flip_s, 3)
        args.perf_model.write_text(json.dumps(model, indent=2) + "\n")
        print(f"{args.perf_model}: flip_s = {flip_s:.3f}")
    sys.exit(1 if result["errors"] else 0)


if __name__ == "__main__":
    main()
