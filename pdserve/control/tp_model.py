"""Performance models of workers wider than one GPU (pure). A worker of width N is described by
a model measured at that width where one is given (`WidthModels.measured`), else derived from the
width-1 model by stated assumptions (`TpAssumptions`), not measurements: compute-bound terms
(p1, p2, d1) shrink by N x `compute_efficiency`, memory-bound ones (d0: weights read a step; d2:
KV read) by N x `memory_efficiency`, each step and prefill pays `collective_s` for its
all-reduces, the KV pool holds N times the tokens, a hand-over reads N ranks at once. A pool
pair of different widths becomes one model (`pool_pair`): the prefill terms of the prefill
width's, the decode terms of the decode width's (docs/tensor-parallel.md, "Placement and control")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.control.perf_model import PerfModel


@dataclass(frozen=True)
class TpAssumptions:
    """How a width-N worker's times follow from width 1's where none was measured at N."""

    compute_efficiency: float = 0.85  # share of the N-fold speed-up matmul-bound terms get
    memory_efficiency: float = 0.9  # ...and the terms bound by reading weights and KV
    collective_s: float = 0.0003  # a step's or a prefill's all-reduces (2 a layer), beyond their bytes

    def __post_init__(self) -> None:
        for k in ("compute_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"{k}: must be in (0, 1], not {getattr(self, k)}")
        if self.collective_s < 0:
            raise ValueError(f"collective_s: must be >= 0, not {self.collective_s}")


def at_width(m: PerfModel, width: int, a: TpAssumptions = TpAssumptions()) -> PerfModel:
    """The width-1 model `m` as a worker of `width` GPUs would run, by the assumptions `a`."""
    if width < 1:
        raise ValueError(f"width: a worker spans at least one GPU, not {width}")
    if width == 1:
        return m
    c, b = width * a.compute_efficiency, width * a.memory_efficiency
    note = (f"tp{width} assumed from width 1: compute terms / {c:g}, memory terms / {b:g}, "
            f"+{a.collective_s:g} s collectives a step, KV x{width}; not measured")
    return replace(
        m, name=f"{m.name} tp{width} (assumed)", p0=m.p0 + a.collective_s, p1=m.p1 / c, p2=m.p2 / c,
        d0=m.d0 / b + a.collective_s, d1=m.d1 / c, d2=m.d2 / b, kv_tokens=m.kv_tokens * width,
        handover_token_s=m.handover_token_s / width, source=f"{m.source} {note}".strip(),
    )  # fmt: skip


@dataclass(frozen=True)
class WidthModels:
    """The width-1 model, models measured at other widths, and the assumptions for the rest."""

    base: PerfModel
    measured: tuple[tuple[int, PerfModel], ...] = ()  # (width, its model), e.g. --tp-perf-model 2=FILE
    assumptions: TpAssumptions = TpAssumptions()

    def __post_init__(self) -> None:
        widths = [w for w, _ in self.measured]
        if any(w < 1 for w in widths) or len(set(widths)) != len(widths):
            raise ValueError(f"tp_perf_model: widths must be >= 1 and given once each, not {widths}")

    def at(self, width: int) -> PerfModel:
        """A worker of `width` GPUs: measured if given, else assumed from width 1."""
        return dict(self.measured).get(width) or at_width(self.base, width, self.assumptions)

    def assumed(self, *widths: int) -> list[int]:
        """Which of `widths` are derived by the assumptions rather than measured."""
        have = {1, *(w for w, _ in self.measured)}
        return sorted({w for w in widths if w not in have})


def pool_pair(prefill: PerfModel, decode: PerfModel) -> PerfModel:
    """One model for a prefill pool of `prefill`'s workers and a decode pool of `decode`'s: the
    prefill and per-request terms of the first, the decode terms and KV room of the second; a
    flip, a start, a hand-over and a cold start cost the slower of the two."""
    if prefill == decode:  # one width: its model as it is
        return prefill
    return replace(
        decode, name=f"{prefill.name} / {decode.name}", p0=prefill.p0, p1=prefill.p1, p2=prefill.p2,
        request_s=prefill.request_s, request_token_s=prefill.request_token_s,
        handover_s=max(prefill.handover_s, decode.handover_s),
        handover_token_s=max(prefill.handover_token_s, decode.handover_token_s),
        flip_s=max(prefill.flip_s, decode.flip_s), start_s=max(prefill.start_s, decode.start_s),
        cold_steps=max(prefill.cold_steps, decode.cold_steps), cold_factor=max(prefill.cold_factor, decode.cold_factor),
        source=f"prefill: {prefill.source} | decode: {decode.source}",
    )  # fmt: skip


@dataclass(frozen=True)
class PoolWidths:
    """The widths a simulation or plan runs: each pool's, the colocated workers', and their models."""

    models: WidthModels
    prefill: int = 1
    decode: int = 1
    colocated: int = 1

    def __post_init__(self) -> None:
        for k in ("prefill", "decode", "colocated"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}_tensor_parallel_size: must be >= 1, not {getattr(self, k)}")

    def pair(self) -> PerfModel:
        """The disaggregated pools' model (`pool_pair` of the two widths')."""
        return pool_pair(self.models.at(self.prefill), self.models.at(self.decode))

    def colocated_model(self) -> PerfModel:
        return self.models.at(self.colocated)

    def assumed(self) -> list[int]:
        """The widths in use whose model is assumed, not measured."""
        return self.models.assumed(self.prefill, self.decode, self.colocated)
