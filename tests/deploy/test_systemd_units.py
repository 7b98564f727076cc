"""deploy/systemd's units: systemd's own check passes (with the pdserve this test runs standing in
for /opt/pdserve/venv/bin/pdserve), and each ExecStart's arguments parse as pdserve's."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import _build_parser

pytestmark = pytest.mark.deploy

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
INSTALLED = "/opt/pdserve/venv/bin/pdserve"


def exec_start(unit: Path) -> list[str]:
    text = unit.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


@pytest.mark.parametrize("name", ["pdserve.service", "pdserve-router.service"])
def test_the_unit_passes_systemd_analyze_and_its_command_parses(tmp_path, name):
    words = exec_start(UNITS / name)
    assert words[0] == INSTALLED
    args = [w.replace("${PDSERVE_RAY_ADDRESS}", "127.0.0.1:6379") for w in words[1:]]
    parsed = _build_parser().parse_args(args)  # SystemExit (exit 2) on a flag pdserve does not know
    assert parsed.command in ("serve", "router")
    assert not any("api-key" in w for w in words), "keys belong in the environment file, not in argv"
    if parsed.command == "serve":
        # Short enough for Ray's socket paths, and under the unit's RuntimeDirectory.
        assert parsed.ray_temp_dir.startswith("/run/pdserve/") and "RuntimeDirectory=pdserve" in (UNITS / name).read_text()

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here; the arguments were checked")
    stand_in = tmp_path / "pdserve"
    stand_in.write_text(f"#!/bin/sh\nexec {sys.executable} -m pdserve.cli \"$@\"\n")
    stand_in.chmod(0o755)
    unit = tmp_path / name
    unit.write_text((UNITS / name).read_text().replace(INSTALLED, str(stand_in)))
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, check=False, timeout=60,
        env=os.environ | {"SYSTEMD_LOG_LEVEL": "warning"},
    )
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
