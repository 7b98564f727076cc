"""deploy/ray/launch.sh's pool widths without starting Ray: `serve --prefill-tp N --decode-tp M`
reach `pdserve serve` as --prefill/--decode-tensor-parallel-size, which pdserve's own parser
reads as each pool's width, other serve flags (-tp among them) pass through unchanged, and a
width that is not a whole number of ranks is refused in one line before anything runs. The Python
the script runs (PDSERVE_PYTHON) is a stand-in that records its arguments instead of serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import _build_parser
from pdserve.cluster.main import config_from_args

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "ray" / "launch.sh"


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    (state / "auth_token").write_text("0" * 64)
    recorder = tmp_path / "python"
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    recorder.chmod(0o755)
    env = os.environ | {"PDSERVE_RAY_DIR": str(state), "PDSERVE_PYTHON": str(recorder)}
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, check=False, timeout=60)


def serve_widths(argv: list[str]) -> tuple[int, int]:
    assert argv[:3] == ["-m", "pdserve.cli", "serve"], argv
    cfg = config_from_args(_build_parser().parse_args(argv[2:]))
    return cfg.prefill_tensor_parallel_size, cfg.decode_tensor_parallel_size


@pytest.mark.parametrize(
    "flags, widths",
    [
        (["--prefill-tp", "2", "--decode-tp", "1"], (2, 1)),
        (["--prefill-tp", "1", "--decode-tp", "2"], (1, 2)),
        (["--decode-tp", "4"], (1, 4)),
        (["-tp", "2"], (2, 2)),  # pdserve's own flag, passed through
        (["-tp", "2", "--decode-tp", "1"], (2, 1)),
    ],
)
def test_pool_widths_reach_pdserve_serve(tmp_path: Path, flags: list[str], widths: tuple[int, int]) -> None:
    proc = launch(tmp_path, "serve", "--address", "10.0.0.1:6379", "--prefill", "1", *flags, "--decode", "2")
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout.strip().splitlines()[-1])
    assert serve_widths(argv) == widths
    assert argv[argv.index("--decode") + 1] == "2" and argv[argv.index("--address") + 1] == "10.0.0.1:6379"


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--address", "10.0.0.1:6379", "--prefill-tp", "0"], "--prefill-tp: '0' is not a worker width"),
        (["serve", "--address", "10.0.0.1:6379", "--decode-tp", "1.5"], "--decode-tp: '1.5' is not a worker width"),
        (["serve", "--address", "10.0.0.1:6379", "--decode-tp", "two"], "--decode-tp: 'two' is not a worker width"),
        (["serve", "--address", "10.0.0.1:6379", "--prefill-tp"], "--prefill-tp: '' is not a worker width"),
        (["router", "--address", "10.0.0.1:6379", "--decode-tp", "2"], "--decode-tp: only 'serve' starts workers"),
    ],
)
def test_a_bad_width_is_refused_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = launch(tmp_path, *args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: ") and message in lines[0], proc.stderr
