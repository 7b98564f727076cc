"""The router runs without torch: importing it, or any placement module, must not load it
(the package root exports the engine's names lazily). Checked in a fresh interpreter, since
this one may have loaded torch for other tests already."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ROUTER_MODULES = (
    "pdserve.router.router", "pdserve.router.edge.grpc_server", "pdserve.router.edge.http_server",
    "pdserve.router.placement.pool_state", "pdserve.router.placement.strategies",
    "pdserve.router.placement.decode_strategy", "pdserve.router.placement.placement_config",
    "pdserve.router.placement.scoring", "pdserve.router.placement.ring", "pdserve.router.placement.prefix_index",
    "pdserve.router.load.recent_load", "bench.placement", "pdserve.cluster.worker_client",
)


def _modules_loaded_by(*modules: str) -> set[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('\\n'.join(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_router_and_placement_modules_import_without_torch():
    loaded = _modules_loaded_by(*ROUTER_MODULES)
    assert set(ROUTER_MODULES) <= loaded  # the check saw the imports it is about
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}


def test_the_package_root_loads_the_engine_only_when_asked():
    assert "torch" not in _modules_loaded_by("pdserve")
    code = "import pdserve; from pdserve import SamplingParams; print(SamplingParams(max_tokens=3).max_tokens)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr


def _router_imports(path: Path) -> set[str]:
    """Every `pdserve.router.*` module a file imports, those for type checking only included."""
    tree = ast.parse(path.read_text())
    return {
        n.module for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pdserve.router.")
    }


def test_placement_strategies_sit_below_the_pool_state_and_its_config():
    """The pool state imports the strategies and the config; the strategies import neither, not
    even for types, so they form no cycle."""
    placement = ROOT / "router" / "placement"
    ring, scoring = "pdserve.router.placement.ring", "pdserve.router.placement.scoring"
    strategies, config = "pdserve.router.placement.strategies", "pdserve.router.placement.placement_config"
    assert _router_imports(placement / "strategies.py") <= {ring, scoring}
    assert _router_imports(placement / "decode_strategy.py") <= {strategies, scoring}
    assert _router_imports(placement / "placement_config.py") == {strategies}
    assert {strategies, config} <= _router_imports(
        placement / "pool_state.py"
    )
