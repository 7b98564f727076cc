"""TTFT and the hand-over with and without `--kv-transfer-overlap`, on a long-prompt workload.

One Ray cluster (1 prefill, 1 decode worker) gets --requests long random prompts one at a time,
prefilled in --chunk-tokens chunks, the router's overlap setting alternating between requests on
the same workers. Per request, from the client: TTFT, the second token (the decode worker's first,
after the hand-over) and the gap between them; medians per mode after --warmup requests.

    python bench/kv_overlap.py --device cpu [--requests 20] [--prompt-tokens 2048] [--chunk-tokens 256]
    python bench/kv_overlap.py --device cuda --dtype bfloat16 --model DIR --prompt-tokens 16384 --chunk-tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.report import cpu_name, markdown_table, write_json
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ServeConfig
from pdserve.engine.args import EngineArgs
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

MODES = ("off", "on")


@dataclasses.dataclass(frozen=True)
class Sample:
    mode: str
    ttft_s: float
    second_s: float  # the second token's arrival, from the request's start

    @property
    def gap_s(self) -> float:
        return self.second_s - self.ttft_s


def _one(stub: Any, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(first token, second token) arrival times of one streamed request, in seconds from its start."""
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    arrivals: list[float] = []
    for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params), timeout=600):
        arrivals.extend([time.perf_counter() - t0] * len(chunk.token_ids))
    if len(arrivals) < 2:
        raise RuntimeError(f"expected at least 2 tokens, got {len(arrivals)}")
    return arrivals[0], arrivals[1]


def summarize(samples: list[Sample]) -> list[list[str]]:
    """One row per mode: medians of TTFT, the second token and the gap (ms), and the count."""
    rows = []
    for mode in MODES:
        got = [s for s in samples if s.mode == mode]
        if not got:
            continue
        med = [statistics.median(getattr(s, f) for s in got) * 1e3 for f in ("ttft_s", "second_s", "gap_s")]
        rows.append([mode, *(f"{m:.1f}" for m in med), str(len(got))])
    return rows


async def _run(args: argparse.Namespace) -> list[Sample]:
    blocks = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    engine = EngineArgs(max_num_batched_tokens=args.chunk_tokens, **blocks)
    cfg = ServeConfig(model=args.model, device=args.device, dtype=args.dtype, port=0, engine=engine)
    cluster = await Cluster.start(cfg, worker_logs=False)
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    try:
        vocab = cluster.router.config.vocab_size
        base = cluster.router.config
        with grpc.insecure_channel(cluster.address) as ch:
            stub = pbg.InferenceStub(ch)
            for i in range(2 * (args.warmup + args.requests)):
                mode = MODES[i % 2]
                cluster.router.config = dataclasses.replace(base, kv_transfer_overlap=mode == "on")
                ids = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
                first, second = await asyncio.to_thread(_one, stub, ids, args.max_tokens)
                if i >= 2 * args.warmup:
                    samples.append(Sample(mode, first, second))
    finally:
        await cluster.stop()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="model directory or name (default: the embedded default model)")
    ap.add_argument("--requests", type=int, default=20, help="measured requests per mode (default: 20)")
    ap.add_argument("--warmup", type=int, default=2, help="requests per mode not counted (default: 2)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--chunk-tokens", type=int, default=256, help="the engine's max_num_batched_tokens (default: 256)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (at least 2)")
    ap.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks per worker (0: sized from memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the samples and medians as JSON here ('-': stdout)")
    args = ap.parse_args()
    if args.max_tokens < 2:
        ap.error("--max-tokens: at least 2 (the second token is what the hand-over delays)")
    if args.prompt_tokens <= args.chunk_tokens:
        ap.error("--prompt-tokens: must exceed --chunk-tokens, or there is no chunk to overlap")
    samples = asyncio.run(_run(args))
    print(f"{args.device} ({cpu_name()}), prompt {args.prompt_tokens} tokens in chunks of {args.chunk_tokens}, "
          f"{args.max_tokens} generated, medians of {args.requests} requests per mode, interleaved")
    print(markdown_table(["overlap", "TTFT ms", "2nd token ms", "gap ms", "n"], summarize(samples)))
    if args.json:
        write_json(args.json, json.dumps({
            "args": vars(args), "samples": [dataclasses.asdict(s) for s in samples], "medians": summarize(samples),
        }, indent=1))


if __name__ == "__main__":
    main()
