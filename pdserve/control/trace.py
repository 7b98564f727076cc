"""Traces for the simulator: JSON lines `{"t", "input_len" | "input_ids", "output_len", "session"?}`
(the router benchmark's format, plus `input_len` where token ids do not matter)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.hashing import block_hashes


@dataclass(frozen=True)
class SimRequest:
    t: float
    input_len: int
    output_len: int
    hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks (none with input_len)


def load_trace(path: Path, block_size: int = 16) -> list[SimRequest]:
    """Read and check a trace; sorted by arrival time."""
    reqs = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ids = d.get("input_ids")
                if ids is not None:
                    if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                        raise ValueError("input_ids: must be a non-empty list of token ids")
                    length, hashes = len(ids), tuple(block_hashes(ids, block_size))
                else:
                    length, hashes = int(d["input_len"]), ()
                    if length < 1:
                        raise ValueError("input_len: must be >= 1")
                out = int(d.get("output_len", 1))
                if out < 1:
                    raise ValueError("output_len: must be >= 1")
                reqs.append(SimRequest(float(d["t"]), length, out, hashes))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{n}: {exc}") from None
    if not reqs:
        raise ValueError(f"trace: {path} holds no requests")
    reqs.sort(key=lambda r: r.t)
    return reqs
