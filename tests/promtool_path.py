"""Where promtool is for the tests that check metrics and dashboard queries with it: on PATH, or
where the README's set-up (scripts/setup.sh) unpacks it."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def promtool() -> str:
    found = shutil.which("promtool") or str(REPO / ".tools/prometheus/usr/bin/promtool")
    assert Path(found).exists(), "promtool not found: run the set-up command of the README (scripts/setup.sh)"
    return found
