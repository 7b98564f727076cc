"""What `bench/gpu_serve.py` sends: the workloads, the rates they are offered at, and the named
profiles (a shape, workloads, rates and SLOs under one flag) that the docs' tables come from.
Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench.serve_workload import Request, Shape, lognormal, prefix_groups


@dataclass(frozen=True)
class Workload:
    """Lengths in tokens at scale 1 (a GPU serving a 1B-8B model); `scale` shrinks them for a CPU."""

    name: str
    shape: Shape  # prompt (or, with a prefix, the suffix after it) and output lengths
    max_input: int
    max_output: int
    prefix_len: int = 0  # > 0: every prompt starts with one of `groups` shared prefixes this long
    groups: int = 0

    def requests(self, n: int, seed: int, scale: float = 1.0) -> list[Request]:
        max_input = max(1, round(self.max_input * scale))
        if self.prefix_len:
            return prefix_groups(n, seed, self.groups, self.prefix_len, self.shape, max_input, self.max_output, scale)
        return lognormal(self.shape, n, seed, max_input, self.max_output, scale)

    def max_len(self, scale: float = 1.0) -> int:
        """The longest prompt + output a request can have: the context the servers must allow."""
        return round(self.prefix_len * scale) + max(1, round(self.max_input * scale)) + self.max_output


# Lognormal medians from means: mean = median * exp(sigma^2 / 2).
WORKLOADS: dict[str, Workload] = {
    # RAG-like: a long retrieved context, a short answer; nearly fixed lengths.
    "long-prompt": Workload("long-prompt", Shape(3000, 150, sigma=0.1), max_input=3600, max_output=180),
    # Chat: means ~1000 prompt and ~200 output tokens, lognormal sigma 0.5.
    "chat": Workload("chat", Shape(882, 176, sigma=0.5), max_input=4000, max_output=600),
    # 8 shared 2048-token prefixes (system prompts, documents), each request its own ~128-token
    # question and ~128-token answer: what a prefix cache (and cache-aware placement) is for.
    "prefix-sharing": Workload(
        "prefix-sharing", Shape(128, 128, sigma=0.5), max_input=512, max_output=512, prefix_len=2048, groups=8
    ),
}

# Offered rates (requests/s) by model shape, chosen to run from well below to beyond what two
# GPUs serve within the SLOs; `--rates` replaces them. "cpu": the default model at --device cpu.
DEFAULT_RATES: dict[str, dict[str, tuple[float, ...]]] = {
    "1b": {"long-prompt": (4, 8, 16, 32), "chat": (4, 8, 16, 32), "prefix-sharing": (4, 8, 16, 32)},
    "8b": {"long-prompt": (1, 2, 4, 8), "chat": (1, 2, 4, 8), "prefix-sharing": (2, 4, 8, 16)},
    "cpu": {"long-prompt": (0.5, 1), "chat": (0.5, 1), "prefix-sharing": (0.5, 1)},
}


@dataclass(frozen=True)
class Profile:
    """A named plan, one flag for a table the docs quote: the model shape, the workloads and
    their rates on 2 GPUs (4 GPUs: twice them, as the defaults) and the SLOs. Flags given
    beside `--profile` (--shape, --workloads, --rates, --slo-*) override its values."""

    shape: str
    rates: dict[str, tuple[float, ...]]
    slo_ttft_ms: float = 1000.0
    slo_itl_ms: float = 50.0
    about: str = ""
    also_itl_ms: tuple[float, ...] = ()  # each run also judged by these mean ITL SLOs (same TTFT)
    gpus: int | None = None  # the --gpus it is for (None: either)
    servers: tuple[str, ...] = ()  # the configurations it runs where --servers is not given (): the defaults)
    # Seconds of arrivals per run (None: --duration-s's default). Past the knee a queue grows for
    # as long as arrivals last: a short window flatters the server whose queue grows.
    duration_s: float | None = None


PROFILES: dict[str, Profile] = {
    "knee-1b": Profile(
        "1b", {"long-prompt": (48, 96, 160), "chat": (48, 96, 160)},
        about="1B shape from below to past where 2 GPUs keep the SLOs",
    ),
    "knee-8b": Profile(
        "8b", {"long-prompt": (8, 16, 24), "chat": (16, 32, 48)},
        about="8B shape from below to past where 2 GPUs keep the SLOs",
    ),
    # A tight inter-token SLO: where prefills sharing a GPU with decodes cost the decodes their
    # ITL, which is what disaggregation removes.
    "interference": Profile(
        "8b", {"chat": (24, 32, 40), "long-prompt": (12, 16)}, slo_itl_ms=12.0, duration_s=8.0,
        about="8B shape under a 12 ms mean ITL SLO: prefill-decode interference; 8 s of arrivals a run",
    ),
    # One set of 8B servers for both tables (start-ups are most of the time): every rate of
    # either, each run judged by both SLOs; `--report-only --profile knee-8b|interference`
    # then writes either table from the same runs.
    "8b-both": Profile(
        "8b", {"long-prompt": (8, 12, 16, 24), "chat": (16, 24, 32, 40, 48)}, also_itl_ms=(12.0,),
        about="knee-8b's and interference's rates on one set of 8B servers, judged by both ITL SLOs",
    ),
    # Tensor parallel on 4 GPUs: knee-8b's per-GPU rates (doubled on 4 GPUs, as every profile's),
    # so each server meets the load under which 2 GPUs of one-GPU workers go from within the SLOs
    # to past them; whether TP2 moves that knee is what the table shows.
    "tp-8b": Profile(
        "8b", {"long-prompt": (8, 16, 24), "chat": (16, 32, 48)}, gpus=4,
        servers=("pdserve-1p2d-tp2", "pdserve-colocated-tp2", "vllm-serve-tp2dp2"),
        about="8B shape on 4 GPUs: a TP2 prefill and two TP1 decode workers against two colocated TP2 workers "
        "and vllm serve TP2 x DP2, at knee-8b's rates",
    ),
}  # fmt: skip


def parse_rates(
    specs: Sequence[str], workloads: Sequence[str], defaults: dict[str, tuple[float, ...]]
) -> dict[str, tuple[float, ...]]:
    """`--rates` values: "R1,R2,..." for every workload or "WORKLOAD=R1,R2,..." for one; the rest
    keep their defaults. Rates come back sorted (the sweep stops at the first saturated one)."""
    out = {w: tuple(defaults[w]) for w in workloads}
    for spec in specs:
        name, sep, values = spec.rpartition("=")
        try:
            rates = tuple(sorted(float(v) for v in values.split(",") if v.strip()))
        except ValueError as exc:
            raise ValueError(f"--rates {spec!r}: rates must be numbers") from exc
        if not rates or any(r <= 0 for r in rates):
            raise ValueError(f"--rates {spec!r}: give positive rates")
        if sep and name not in out:
            raise ValueError(f"--rates {spec!r}: unknown workload {name!r}; one of {', '.join(out)}")
        for w in [name] if sep else list(out):
            out[w] = rates
    return {w: tuple(sorted(r)) for w, r in out.items()}


def requests_per_run(rate: float, duration_s: float, fixed: int | None, least: int = 4) -> int:
    """--requests N, else the arrivals of duration_s at this rate (at least `least`)."""
    return fixed if fixed else max(least, math.ceil(rate * duration_s))
