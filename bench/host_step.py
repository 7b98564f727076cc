"""The engine's host work per overlapped decode step, as the answers grow (CPU, no GPU needed).

A small model's decode step on a GPU is as short as the host's bookkeeping around it (scheduling
the next step, the step's inputs, the outputs of every row, detokenizing), and overlapped steps
hide that work only while it is shorter than the device's. This runs a tiny random model on
CPU (so the forward is small) with overlapped steps at batch B and reports the host's CPU time
per step (the step's thread time less the forward's), at several lengths of the answers so far:
work that grows with them shows as a rising column.

    python bench/host_step.py [--batch 128] [--tokens 1200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_model import write_tokenizer  # noqa: E402
from bench.report import markdown_table, write_json  # noqa: E402
from pdserve import LLM, SamplingParams  # noqa: E402

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
PROMPT = 64
SAMPLE = 20  # steps per sample


def host_times(batch: int, tokens: int) -> list[tuple[int, float, float]]:
    """(tokens generated so far, host CPU ms a step, forward CPU ms a step) per SAMPLE steps."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY))
        write_tokenizer(Path(tmp), TINY["vocab_size"], TINY["bos_token_id"], TINY["eos_token_id"])
        blocks = batch * (-(-(PROMPT + tokens + 2 * SAMPLE) // 16) + 1) + 64
        llm = LLM(tmp, device="cpu", dtype="float32", load_format="dummy", max_model_len=PROMPT + tokens + 64,
                  max_num_seqs=batch, num_kv_blocks=blocks, overlap_decode=True)
    engine, runner = llm.engine, llm.engine.runner
    forward_s = [0.0]
    forward = runner._forward

    def timed_forward(*args, **kwargs):
        t = time.thread_time()
        try:
            return forward(*args, **kwargs)
        finally:
            forward_s[0] += time.thread_time() - t

    runner._forward = timed_forward
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tokens + 2 * SAMPLE, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(10, TINY["vocab_size"]) for _ in range(PROMPT)], params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step())
    rows, done = [], 0
    while done < tokens:
        forward_s[0] = 0.0
        t = time.thread_time()
        for _ in range(SAMPLE):
            engine.step()
        step = (time.thread_time() - t) / SAMPLE
        rows.append((done, (step - forward_s[0] / SAMPLE) * 1e3, forward_s[0] / SAMPLE * 1e3))
        done += SAMPLE
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1200, help="tokens each answer grows to")
    ap.add_argument("--json", help="write the samples as JSON here ('-' for stdout)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the forward's time stays on the thread that steps
    rows = host_times(args.batch, args.tokens)
    quarter = max(1, len(rows) // 4)
    table = []
    for k in range(0, len(rows), quarter):
        part = rows[k : k + quarter]
        table.append([f"{part[0][0]}-{part[-1][0] + SAMPLE}", f"{statistics.median(r[1] for r in part):.3f}",
                      f"{statistics.median(r[2] for r in part):.3f}"])
    print(f"\nbatch {args.batch}, overlapped decode steps, CPU ms a step (median of each range)\n")
    print(markdown_table(["tokens generated", "host", "forward (tiny model)"], table))
    if args.json:
        write_json(args.json, json.dumps({"batch": args.batch, "samples": rows}))


if __name__ == "__main__":
    main()
