"""docs/architecture.md's module table names every top-level folder and Python sub-package of the
tree, each once, and nothing that is not there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("pdserve", "pdserve_proto", "prefill_worker", "decode_worker", "kv_transfer", "router")


def table_rows() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)/` \|", section, flags=re.M)


def source_files() -> list[str]:
    """The repository's files: git's list where this is a git checkout, else the tree less what
    set-up and tests write (hidden folders, build metadata, caches)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        return listed.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        skip = ("__pycache__", ".egg-info")
        return [
            str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not any(part.startswith(".") or part.endswith(skip) for part in p.relative_to(ROOT).parts)
        ]


def tracked_folders() -> set[str]:
    """Top-level folders with tracked files, and every first-party Python sub-package."""
    files = source_files()
    folders = {f.split("/")[0] for f in files if "/" in f and not f.startswith(".")}
    packages = {
        str(Path(f).parent) for f in files
        if f.endswith("/__init__.py") and f.split("/")[0] in FIRST_PARTY and f.count("/") >= 2
    }
    return folders | packages


def test_the_module_table_matches_the_tree():
    rows = table_rows()
    assert len(rows) == len(set(rows)), f"listed twice: {sorted(r for r in rows if rows.count(r) > 1)}"
    listed, present = set(rows), tracked_folders()
    assert not present - listed, f"in the tree but not in docs/architecture.md's module table: {sorted(present - listed)}"
    assert not listed - present, f"in the module table but not in the tree: {sorted(listed - present)}"
