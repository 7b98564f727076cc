"""Synthetic request traces for the router benchmark: one JSON object a line,
{"t": seconds, "input_ids": [...], "output_len": n, "session": id}, Poisson arrivals of a mix of
multi-turn sessions (private reuse), RAG questions over Zipf-popular contexts (shared reuse),
unique prompts and, optionally, one hot system prompt. Every chat-style prompt starts with the
same template tokens, which makes a ring key of only the first block useless. Presets: `mixed`,
`hot` (half the requests behind one system prompt) and `private` (two-turn sessions, no template).

    python bench/traces.py --out trace.jsonl [--preset mixed|hot|private] [--requests 4000] [--rate 200]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    t: float
    input_ids: list[int]
    output_len: int
    session: str | None = None

    def to_json(self) -> str:
        d: dict = {"t": round(self.t, 6), "input_ids": self.input_ids, "output_len": self.output_len}
        if self.session is not None:
            d["session"] = self.session
        return json.dumps(d, separators=(",", ":"))


@dataclass(frozen=True)
class TraceConfig:
    requests: int = 4000
    rate: float = 200.0  # requests per second, all kinds together
    seed: int = 0
    vocab: int = 49152  # the default model's, so a trace also drives a real cluster
    session_share: float = 0.5
    rag_share: float = 0.3  # the rest is unique prompts
    hot_share: float = 0.0  # taken off the top; the other kinds share what is left
    template_len: int = 24  # tokens every chat-style prompt starts with
    system_prompts: int = 24  # 0: every session has a system prompt of its own
    system_len: tuple[int, int] = (150, 600)
    zipf_s: float = 1.1
    turns: tuple[int, int] = (2, 8)
    user_len: tuple[int, int] = (20, 200)
    reply_len: tuple[int, int] = (40, 400)
    think_s: float = 5.0  # mean pause between a reply and the next user message
    decode_s_per_token: float = 0.02  # how long a reply takes to stream, for turn spacing
    rag_topics: int = 300
    rag_docs: tuple[int, int] = (2, 4)
    rag_doc_len: tuple[int, int] = (300, 900)
    question_len: tuple[int, int] = (10, 60)
    unique_len: tuple[int, int] = (100, 1500)

    def __post_init__(self) -> None:
        shares = (self.session_share, self.rag_share, self.hot_share)
        if min(shares) < 0 or self.session_share + self.rag_share > 1 or self.hot_share > 1:
            raise ValueError("session_share/rag_share/hot_share: must be shares of requests in [0, 1]")
        if self.requests < 1 or self.rate <= 0:
            raise ValueError("requests/rate: must be positive")


class _Gen:
    def __init__(self, cfg: TraceConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        c = cfg
        self.template = self.tokens(c.template_len)
        self.systems = [self.template + self.tokens(self.between(c.system_len)) for _ in range(c.system_prompts)]
        self._rag_system = self.template + self.tokens(120)
        self.hot = self.template + self.tokens(self.between(c.system_len))
        self._topics: dict[int, list[int]] = {}  # made on first use: a trace may need none

    def topic(self, i: int) -> list[int]:
        if i not in self._topics:
            docs = range(self.between(self.cfg.rag_docs))
            self._topics[i] = self._rag_system + [t for _ in docs for t in self.tokens(self.between(self.cfg.rag_doc_len))]
        return self._topics[i]

    def system(self) -> list[int]:
        c = self.cfg
        if c.system_prompts == 0:
            return self.template + self.tokens(self.between(c.system_len))
        return self.systems[self.zipf(c.system_prompts)]

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.cfg.vocab, n).tolist()

    def between(self, lo_hi: tuple[int, int]) -> int:
        return int(self.rng.integers(lo_hi[0], lo_hi[1] + 1))

    def zipf(self, n: int) -> int:
        """An index in [0, n) with probability proportional to 1 / (i + 1) ** s."""
        w = 1.0 / np.arange(1, n + 1) ** self.cfg.zipf_s
        return int(self.rng.choice(n, p=w / w.sum()))

    def arrivals(self, rate: float, horizon: float) -> Iterator[float]:
        t = 0.0
        while rate > 0:
            t += float(self.rng.exponential(1.0 / rate))
            if t > horizon:
                return
            yield t

    def session(self, start: float, sid: str) -> list[TraceRequest]:
        c = self.cfg
        history = list(self.system())
        out, t = [], start
        for _ in range(self.between(c.turns)):
            history += self.tokens(self.between(c.user_len))
            reply = self.between(c.reply_len)
            out.append(TraceRequest(t, list(history), reply, sid))
            history += self.tokens(reply)  # what the assistant said joins the next prompt
            t += reply * c.decode_s_per_token + float(self.rng.exponential(c.think_s))
        return out


def generate(cfg: TraceConfig) -> list[TraceRequest]:
    """`cfg.requests` requests sorted by arrival time."""
    g = _Gen(cfg)
    c = cfg
    horizon = c.requests / c.rate * 1.5  # generous; cut to the first `requests` below
    rest = 1.0 - c.hot_share
    mean_turns = (c.turns[0] + c.turns[1]) / 2
    reqs: list[TraceRequest] = []
    for i, t in enumerate(g.arrivals(c.rate * rest * c.session_share / mean_turns, horizon)):
        reqs += g.session(t, f"s{i}")
    for t in g.arrivals(c.rate * rest * c.rag_share, horizon):
        reqs.append(TraceRequest(t, g.topic(g.zipf(c.rag_topics)) + g.tokens(g.between(c.question_len)), g.between(c.reply_len)))
    for t in g.arrivals(c.rate * rest * (1 - c.session_share - c.rag_share), horizon):
        reqs.append(TraceRequest(t, g.template + g.tokens(g.between(c.unique_len)), g.between(c.reply_len)))
    for t in g.arrivals(c.rate * c.hot_share, horizon):
        reqs.append(TraceRequest(t, g.hot + g.tokens(g.between(c.user_len)), g.between(c.reply_len)))
    reqs.sort(key=lambda r: r.t)
    return reqs[: c.requests]


PRESETS: dict[str, dict] = {
    "mixed": {},
    "hot": {"hot_share": 0.5, "rate": 400.0},  # busy enough that balance matters
    "private": {
        "session_share": 1.0, "rag_share": 0.0, "system_prompts": 0, "template_len": 0,
        "turns": (2, 2), "think_s": 1.0, "decode_s_per_token": 0.005,
    },
}


def preset(name: str, **overrides: object) -> TraceConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: {name!r} is not one of {', '.join(PRESETS)}")
    return TraceConfig(**{**PRESETS[name], **overrides})


def write(reqs: list[TraceRequest], path: Path) -> None:
    with path.open("w") as f:
        for r in reqs:
            f.write(r.to_json() + "\n")


def load(path: Path) -> list[TraceRequest]:
    """Read a trace, checking each line's fields; sorted by arrival time."""
    reqs = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ids = d["input_ids"]
                if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                    raise ValueError("input_ids: must be a non-empty list of token ids")
                reqs.append(TraceRequest(float(d["t"]), ids, int(d.get("output_len", 0)), d.get("session")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{n}: {exc}") from None
    reqs.sort(key=lambda r: r.t)
    return reqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write a synthetic trace for `pdserve bench router`.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="mixed", choices=list(PRESETS))
    p.add_argument("--requests", type=int, default=TraceConfig.requests)
    p.add_argument("--rate", type=float, default=None, help="requests per second (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hot-share", type=float, default=None, help="share of requests behind one hot system prompt")
    a = p.parse_args(argv)
    extra = {k: v for k, v in (("rate", a.rate), ("hot_share", a.hot_share)) if v is not None}
    cfg = preset(a.preset, requests=a.requests, seed=a.seed, **extra)
    reqs = generate(cfg)
    write(reqs, a.out)
    tokens = sum(len(r.input_ids) for r in reqs)
    print(f"wrote {len(reqs)} requests ({tokens} prompt tokens, {reqs[-1].t:.1f} s) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
