"""Per-worker performance models: what one prefill or decode worker costs, read from JSON files.

A model is the simulator's truth and the controller's prior (until the online fit has enough
warm samples). Shapes:
- prefill of n uncached tokens: `prefill_s(n) = p0 + p1 * n + p2 * n**2` (the n**2 term is
  causal attention);
- one decode step of a batch of b sequences holding c context tokens in all:
  `step_s(b, c) = d0 + d1 * b + d2 * c` (weights read once per step, per-sequence work, KV read);
- a role flip (drain excluded: switch and probe) takes `flip_s`;
- a worker added to the cluster (`--max-workers`) starts in `start_s`: model load, KV pool, links.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if min(self.p0, self.p1, self.p2, self.d0, self.d1, self.d2, self.flip_s, self.start_s) < 0:
            raise ValueError("perf model: costs must be >= 0")
        if self.p1 <= 0 or self.d0 + self.d1 <= 0:
            raise ValueError("perf model: p1 and d0 + d1 must be > 0")
        if self.kv_tokens < 1 or self.max_num_seqs < 1 or self.cold_factor < 1:
            raise ValueError("perf model: kv_tokens, max_num_seqs >= 1 and cold_factor >= 1")

    def prefill_s(self, tokens: float) -> float:
        return self.p0 + self.p1 * tokens + self.p2 * tokens * tokens

    def step_s(self, batch: float, context_tokens: float) -> float:
        return self.d0 + self.d1 * batch + self.d2 * context_tokens

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
