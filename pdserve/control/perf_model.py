"""Per-worker performance models: what one prefill or decode worker costs, read from JSON files
(`models/*.json`, or one written by `bench/engine.py --perf-model`). A model is the simulator's
truth and the controller's prior until the online fit has enough warm samples.

Shapes: `prefill_s(n) = p0 + p1 n + p2 n**2` for n uncached tokens (n**2: causal attention) and
`step_s(b, c) = d0 + d1 b + d2 c` for a decode step of b sequences holding c context tokens
(weights read once a step, per-sequence work, KV read). A flip takes `flip_s`, an added worker
starts in `start_s`. The serving costs beyond the engine's steps and the host model
(`share_slowdown`) are `PerfModel`'s fields (docs/controller.md, "Performance models").
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL = "llama3-8b-h100"


@dataclass(frozen=True)
class PerfModel:
    name: str
    p0: float  # s per prefill (fixed cost)
    p1: float  # s per uncached prompt token
    p2: float  # s per uncached prompt token squared
    d0: float  # s per decode step (fixed cost)
    d1: float  # s per sequence in the step
    d2: float  # s per context token read in the step
    flip_s: float  # switch + probe, once a worker is drained
    kv_tokens: int  # KV pool of one decode worker, in tokens
    max_num_seqs: int  # sequences one decode worker batches
    cold_steps: int = 0  # after a start or a flip, this many steps/prefills run slow...
    cold_factor: float = 1.0  # ...by this factor (caches, allocator, graph capture)
    source: str = ""  # where the figures come from
    # A new worker's start (actor, model load, KV pool, links) until it serves. Files without it
    # get a minute: a guess on the slow side, so an add is not made on a start assumed cheap.
    start_s: float = 60.0
    request_s: float = 0.0  # per request, beyond prefill_s, before its first token: fixed part...
    request_token_s: float = 0.0  # ...and per prompt token
    handover_s: float = 0.0  # first token to the decode worker's first step: fixed part...
    handover_token_s: float = 0.0  # ...and per prompt token
    handover_waits_prefill_step: bool = False  # the hand-over starts once the prefill worker's step ends
    step_extra_s: float = 0.0  # a served decode step beyond step_s: per step...
    step_extra_seq_s: float = 0.0  # ...and per sequence in it
    serve_cpu_s_per_token: float = 0.0  # host CPU a streamed token costs outside the engine
    background_cores: float = 0.0  # host CPU the cluster uses while idle
    share_slowdown: tuple[tuple[float, float], ...] = ()  # (busy engines per core, step-time factor)
    # What prompt chunks add to a decode step beside its decodes (a colocated worker's mixed
    # step): this fixed part plus p1 n + p2 n**2. None: p0, a prefill step's own.
    mixed_p0: float | None = None

    def __post_init__(self) -> None:
        costs = ("p0", "p1", "p2", "d0", "d1", "d2", "flip_s", "start_s", "request_s", "request_token_s",
                 "handover_s", "handover_token_s", "step_extra_s", "step_extra_seq_s", "serve_cpu_s_per_token",
                 "background_cores")
        for k in costs:
            if getattr(self, k) < 0:
                raise ValueError(f"perf model: {k} must be >= 0, got {getattr(self, k)}")
        if self.mixed_p0 is not None and self.mixed_p0 < 0:
            raise ValueError(f"perf model: mixed_p0 must be >= 0, got {self.mixed_p0}")
        if self.p1 <= 0 or self.d0 + self.d1 <= 0:
            raise ValueError("perf model: p1 and d0 + d1 must be > 0")
        if self.kv_tokens < 1 or self.max_num_seqs < 1 or self.cold_factor < 1:
            raise ValueError("perf model: kv_tokens, max_num_seqs >= 1 and cold_factor >= 1")
        table = tuple((float(x), float(y)) for x, y in self.share_slowdown)  # JSON gives lists
        object.__setattr__(self, "share_slowdown", table)
        if table:
            xs = [x for x, _ in table]
            if len(table) < 2 or xs != sorted(set(xs)) or xs[0] < 0 or min(y for _, y in table) < 1:
                raise ValueError("perf model: share_slowdown needs >= 2 points, engines per core increasing from >= 0, "
                                 "slowdowns >= 1")

    def prefill_s(self, tokens: float) -> float:
        return self.p0 + self.p1 * tokens + self.p2 * tokens * tokens

    @property
    def mixed_fixed_s(self) -> float:
        """The fixed cost prompt chunks add to a step that also decodes."""
        return self.p0 if self.mixed_p0 is None else self.mixed_p0

    def mixed_prefill_s(self, tokens: float) -> float:
        """What a prompt of `tokens` adds to steps that also decode (chunked beside them)."""
        return self.prefill_s(tokens) - self.p0 + self.mixed_fixed_s

    def step_s(self, batch: float, context_tokens: float) -> float:
        return self.d0 + self.d1 * batch + self.d2 * context_tokens

    def served_step_s(self, batch: float, context_tokens: float) -> float:
        """A decode step as a serving worker runs it: the engine step and the loop around it."""
        return self.step_s(batch, context_tokens) + self.step_extra_s + self.step_extra_seq_s * batch

    def request_time_s(self, prompt_tokens: float) -> float:
        return self.request_s + self.request_token_s * prompt_tokens

    def handover_time_s(self, prompt_tokens: float) -> float:
        return self.handover_s + self.handover_token_s * prompt_tokens

    def slowdown(self, engines_per_core: float) -> float:
        """The factor on step times of busy engines sharing a host, `engines_per_core` of them
        (fractional: the router's load counts as part of an engine); 1 without a table."""
        t = self.share_slowdown
        if not t or engines_per_core <= t[0][0]:
            return 1.0 if not t else t[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(t):
            if engines_per_core <= x1:
                return y0 + (y1 - y0) * (engines_per_core - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = t[-2], t[-1]
        return max(y1, y1 + (y1 - y0) * (engines_per_core - x1) / (x1 - x0))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def builtin_models() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_perf_model(name_or_path: str | None = None) -> PerfModel:
    """A built-in model by name (see `builtin_models`) or a JSON file written by
    `python bench/engine.py --perf-model FILE`."""
    name = name_or_path or DEFAULT_MODEL
    path = Path(name)
    if not path.is_file():
        path = BUILTIN_DIR / f"{name}.json"
        if not path.is_file():
            raise FileNotFoundError(f"perf model: {name!r} is neither a file nor one of {', '.join(builtin_models())}")
    d = json.loads(path.read_text())
    known = PerfModel.__dataclass_fields__
    unknown = set(d) - set(known)
    if unknown:
        raise ValueError(f"perf model {path}: unknown fields {sorted(unknown)}")
    return PerfModel(**d)
