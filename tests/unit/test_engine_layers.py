"""The engine's modules import each other without cycles, device code below the core.

Checked on the source with `ast` (imports inside functions included, since a lazy import
closes a cycle just as well), so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "pdserve" / "engine"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _engine_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ENGINE.rglob("*.py") if "__pycache__" not in p.parts}


def engine_imports(path: Path, modules: set[str]) -> set[str]:
    """The engine modules `path` imports; `from package import submodule` counts as the submodule."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name in modules and not name.endswith("__init__")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def _graph() -> dict[str, set[str]]:
    modules = _engine_modules()
    names = set(modules)
    return {m: engine_imports(p, names) - {m} for m, p in modules.items()}


def test_no_import_cycle_inside_the_engine():
    graph = _graph()
    assert len(graph) > 10, "engine modules not found"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_device_code_does_not_import_the_core_above_it():
    """kernels/ sees only the config; model/ adds kernels/. Neither reaches the scheduler,
    the runner or the engine, so they can be used and tested on their own."""
    allowed = {
        "pdserve.engine.kernels": ("pdserve.engine.kernels", "pdserve.engine.config"),
        "pdserve.engine.model": ("pdserve.engine.model", "pdserve.engine.kernels", "pdserve.engine.config"),
    }
    violations = []
    for module, imports in _graph().items():
        for part, ok in allowed.items():
            if module.startswith(part + "."):
                violations += [f"{module} imports {i}" for i in imports if not i.startswith(ok)]
    assert not violations, "\n".join(violations)


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
