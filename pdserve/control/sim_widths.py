"""`pdserve simulate` and `pdserve plan`'s tensor-parallel flags: each pool's width (the names of
`pdserve serve`'s) and performance models measured at a width; read into a `PoolWidths`."""

from __future__ import annotations

import argparse

from pdserve.control.perf_model import PerfModel, load_perf_model
from pdserve.control.tp_model import PoolWidths, WidthModels


def add_width_arguments(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size, --prefill/--decode-tensor-parallel-size and --tp-perf-model."""
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1, metavar="N",
                   help="GPUs per worker (tensor-parallel width) of both pools and of colocated workers (default: 1)")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None, metavar="N",
                       help=f"GPUs per {role} worker (default: --tensor-parallel-size)")
    p.add_argument("--tp-perf-model", action="append", default=[], metavar="N=NAME|FILE",
                   help="the performance model of a worker N GPUs wide, measured at that width; repeat for more "
                   "widths. A width without one is derived from --perf-model by assumptions "
                   "(docs/tensor-parallel.md), not measured")


def parse_tp_model(text: str) -> tuple[int, PerfModel]:
    """`N=NAME|FILE` to (N, the model); errors name the flag."""
    width, sep, name = text.partition("=")
    if not sep or not width.strip().isdigit() or int(width) < 1 or not name:
        raise ValueError(f"--tp-perf-model: {text!r} is not N=NAME|FILE with N >= 1")
    return int(width), load_perf_model(name)


def widths_from_args(args: argparse.Namespace, base: PerfModel) -> PoolWidths:
    """The widths and models the flags ask for; `base` is --perf-model's (width 1)."""
    both = args.tensor_parallel_size
    measured = tuple(parse_tp_model(t) for t in args.tp_perf_model)
    if any(w == 1 for w, _ in measured):
        raise ValueError("--tp-perf-model: width 1 is --perf-model's")
    pick = lambda v: both if v is None else v
    for flag, v in (("--tensor-parallel-size", both), ("--prefill-tensor-parallel-size", args.prefill_tensor_parallel_size),
                    ("--decode-tensor-parallel-size", args.decode_tensor_parallel_size)):
        if v is not None and v < 1:
            raise ValueError(f"{flag}: must be >= 1, not {v}")
    return PoolWidths(WidthModels(base, measured), prefill=pick(args.prefill_tensor_parallel_size),
                      decode=pick(args.decode_tensor_parallel_size), colocated=both)


def width_note(w: PoolWidths) -> str | None:
    """A line saying which widths' times are assumed, not measured; None where none is."""
    assumed = w.assumed()
    if not assumed:
        return None
    return (f"tp {', '.join(map(str, assumed))}: times assumed from width 1 (docs/tensor-parallel.md), not measured; "
            "give a measured model with --tp-perf-model N=FILE")
