"""Shared pieces of the benchmarks' reports: the machine they ran on, markdown tables."""

from __future__ import annotations

import argparse
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def markdown_table(head: list[str], body: list[list[str]]) -> str:
    """A markdown table with columns padded to their widest cell."""
    widths = [max(len(x) for x in col) for col in zip(head, *body)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def percent(share: float, sep: str = " ") -> str:
    """A share as a whole percent, with a decimal where rounding would make it read 100 % or 0 %
    when it is not (99.6 % is one request in 256 missed)."""
    value = 100 * share
    digits = 1 if (round(value) == 100 and share < 1) or (round(value) == 0 and share > 0) else 0
    return f"{value:.{digits}f}{sep}%"


def write_json(path: str, payload: str) -> None:
    """A benchmark's `--json` output: to stdout for "-", else to the file at `path`."""
    if path == "-":
        print(payload)
    else:
        Path(path).write_text(payload + "\n")


def add_json_option(ap: argparse.ArgumentParser) -> None:
    """The benches' `--json [PATH]`: also write the results as JSON to PATH, or stdout with none."""
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="also write the results as JSON to PATH (or stdout with no PATH)",
    )
