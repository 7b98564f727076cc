"""Prometheus text exposition as `bench/gpu_serve.py` reads the router's /metrics: its samples,
and a histogram's cumulative bucket counts. Pure: text in, figures out."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def labels_of(text: str | None) -> dict[str, str]:
    """The labels of `a="x",b="y"`, their escapes undone."""
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(text or "")}


def number(text: str) -> float:
    v = float(text)  # "+Inf" and "NaN" parse; neither is a count a run can use
    return v if math.isfinite(v) else 0.0


def samples(metrics_text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line; comments, blank lines and lines whose value
    is not a number skipped."""
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        try:
            value = number(m.group(3))
        except ValueError:
            continue
        yield m.group(1), labels_of(m.group(2)), value


def bucket_counts(metrics_text: str, key: Callable[[str, dict[str, str]], K | None]) -> dict[K, dict[float, float]]:
    """The cumulative counts (upper bound -> count) of `_bucket` samples, added up by
    `key(name, labels)` (its labels without `le`; None: not wanted)."""
    out: dict[K, dict[float, float]] = {}
    for name, labels, value in samples(metrics_text):
        if not name.endswith("_bucket"):
            continue
        le = labels.pop("le", None)
        k = None if le is None else key(name, labels)
        if k is None:
            continue
        bound = math.inf if le == "+Inf" else float(le)
        counts = out.setdefault(k, {})
        counts[bound] = counts.get(bound, 0.0) + value
    return out
