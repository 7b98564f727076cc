"""Every page in docs/ stays short enough to read in one sitting and free of run logs.

A page is at most 25 KB. A page states current figures, each with its card and date, not a lab
notebook: it names at most three distinct dates (YYYY-MM-DD) and no time of day (`06:19 UTC`,
`06:19-06:32`). Superseded rounds belong in git history, where a date per run is free."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
MAX_BYTES = 25 * 1024
MAX_DATES = 3
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# A clock time as run logs write it, HH:MM with two-digit hours, not part of a longer number
# (an address and port, a ratio such as 2:1 or 1:32).
TIME_OF_DAY = re.compile(r"(?<![\d:.])(?:[01]\d|2[0-3]):[0-5]\d(?![\d:])")

PAGES = sorted(DOCS.glob("*.md"))


def test_there_are_pages():
    assert PAGES, f"no pages in {DOCS}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_is_at_most_25_kb(page: Path):
    size = page.stat().st_size
    assert size <= MAX_BYTES, f"{page.name} is {size} bytes, over {MAX_BYTES}: move what is superseded to git history"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_is_not_a_run_log(page: Path):
    text = page.read_text()
    dates = sorted(set(DATE.findall(text)))
    assert len(dates) <= MAX_DATES, f"{page.name} names {len(dates)} dates {dates}: keep the current figures only"
    times = TIME_OF_DAY.findall(text)
    assert not times, f"{page.name} has times of day {times[:5]}: a figure needs its date, not its minute"


def test_the_rules_catch_a_lab_notebook():
    notebook = "Run 2026-11-25 06:19-06:32 UTC; rerun 2026-11-26 10:16 UTC; 2026-11-27; 2026-11-28."
    assert len(set(DATE.findall(notebook))) > MAX_DATES
    assert TIME_OF_DAY.findall(notebook) == ["06:19", "06:32", "10:16"]
    assert not TIME_OF_DAY.findall("127.0.0.1:50051, --split 2:1, 3P:1D, localhost:8000, 1:32")
