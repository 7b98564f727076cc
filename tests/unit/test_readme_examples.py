"""The README's benchmark examples are sized for a laptop CPU unless labelled for a GPU: the
work each asks for (output tokens to generate, seconds of arrivals) fits in a minute or two."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from bench.serve import add_arguments, make_requests

README = Path(__file__).resolve().parents[2] / "README.md"
# A CPU decodes the default model at ~7-15 tokens/s per stream on 2 cores; a batch does better.
MAX_OUTPUT_TOKENS = 1000
MAX_ARRIVAL_S = 90.0


def _examples() -> list[tuple[str, str]]:
    """(text before the code block, command) for each `pdserve bench serve` in a README code block."""
    found, text = [], README.read_text()
    for m in re.finditer(r"```bash\n(.*?)```", text, re.S):
        lead = text[: m.start()].rsplit("```", 1)[-1]  # the prose since the previous block
        for cmd in m.group(1).replace("\\\n", " ").splitlines():
            if "pdserve bench serve" in cmd:
                found.append((lead, cmd.split("#", 1)[0].strip().removeprefix("$ ")))
    return found


def _work(cmd: str) -> tuple[int, float]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(shlex.split(cmd)[3:])
    requests = make_requests(args)
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.rate]
    return sum(r.output_len for r in requests) * len(rates), sum(len(requests) / r for r in rates if r)


def test_cpu_sized_bench_examples_fit_in_a_minute_or_two():
    cpu = [cmd for lead, cmd in _examples() if "GPU" not in lead]
    assert cpu, "the README shows no CPU-sized `pdserve bench serve` example"
    for cmd in cpu:
        tokens, arrivals_s = _work(cmd)
        assert tokens <= MAX_OUTPUT_TOKENS and arrivals_s <= MAX_ARRIVAL_S, (cmd, tokens, arrivals_s)
