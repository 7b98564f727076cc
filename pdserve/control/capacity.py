"""Per-worker capacity models fitted online: how fast each worker really prefills and decodes.

The shape of the costs comes from a `PerfModel` (the prior); each worker's samples fit one
scale per kind (measured time / the prior's time for the same work), and the pool's estimate
is the median over warm workers. A worker's first `skip` samples after it starts or flips are
ignored: cold caches, allocation and graph capture make them slow, and a controller that
believed them would over-scale the pool the worker just joined.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace

from pdserve.control.perf_model import PerfModel


@dataclass(frozen=True)
class CapacityConfig:
    skip: int = 8  # samples ignored after a start or a flip
    window: int = 64  # samples kept per worker and kind
    min_samples: int = 4  # warm samples a worker needs before its scale counts

    def __post_init__(self) -> None:
        if self.skip < 0 or self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError("capacity: skip >= 0, window >= 1, 1 <= min_samples <= window")


class _Worker:
    def __init__(self, cfg: CapacityConfig) -> None:
        self.cold = cfg.skip
        self.ratios: deque[float] = deque(maxlen=cfg.window)


class CapacityModel:
    """Fed with timed steps as they happen; read with `estimate()`. No I/O."""

    def __init__(self, prior: PerfModel, cfg: CapacityConfig = CapacityConfig()) -> None:
        self.prior = prior
        self.cfg = cfg
        self._prefill: dict[str, _Worker] = {}
        self._decode: dict[str, _Worker] = {}

    def started(self, worker: str) -> None:
        """The worker (re)started or changed role: its next samples are cold; its old ones, of
        the other role or another process, no longer describe it."""
        self._prefill[worker] = _Worker(self.cfg)
        self._decode[worker] = _Worker(self.cfg)

    def forget(self, worker: str) -> None:
        self._prefill.pop(worker, None)
        self._decode.pop(worker, None)

    def prefill_sample(self, worker: str, tokens: int, seconds: float) -> bool:
        """One prefill of `tokens` uncached tokens took `seconds`. False: ignored (cold)."""
        return self._add(self._prefill, worker, seconds / self.prior.prefill_s(tokens))

    def decode_sample(self, worker: str, batch: int, context_tokens: int, seconds: float) -> bool:
        """One decode step of `batch` sequences, `context_tokens` in all, took `seconds`."""
        return self._add(self._decode, worker, seconds / self.prior.step_s(batch, context_tokens))

    def _add(self, table: dict[str, _Worker], worker: str, ratio: float) -> bool:
        w = table.get(worker)
        if w is None:
            self.started(worker)
            w = table[worker]
        if w.cold > 0:
            w.cold -= 1
            return False
        w.ratios.append(ratio)
        return True

    def _scale(self, table: dict[str, _Worker]) -> float | None:
        warm = [statistics.median(w.ratios) for w in table.values() if len(w.ratios) >= self.cfg.min_samples]
        return statistics.median(warm) if warm else None

    def scales(self) -> tuple[float | None, float | None]:
        """(prefill, decode) scales against the prior; None where no worker is warm yet."""
        return self._scale(self._prefill), self._scale(self._decode)

    def estimate(self) -> PerfModel:
        """The prior scaled by what warm workers measured (the prior alone until they have)."""
        ps, ds = self.scales()
        m = self.prior
        ps = 1.0 if ps is None else ps
        ds = 1.0 if ds is None else ds
        return replace(
            m, p0=m.p0 * ps, p1=m.p1 * ps, p2=m.p2 * ps, d0=m.d0 * ds, d1=m.d1 * ds, d2=m.d2 * ds,
            name=f"{m.name} (fitted)",
        )
