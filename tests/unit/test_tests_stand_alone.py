"""Test modules share code through fixtures and support modules, never by importing another test
module or a conftest (pytest loads those itself; importing them runs their fixtures' module twice)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _is_test_module(name: str) -> bool:
    """Ours (`tests....`, or a sibling imported by bare name) and a test module or a conftest."""
    if not (name.startswith(("tests.", "test_")) or name == "conftest"):
        return False
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def test_no_test_module_imports_another_test_module_or_a_conftest():
    offenders = [
        f"{path.relative_to(TESTS.parent)} imports {name}"
        for path in TESTS.rglob("*.py")
        if "__pycache__" not in path.parts
        for name in _imported_modules(path)
        if _is_test_module(name)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_such_an_import(tmp_path):
    bad = tmp_path / "test_x.py"
    bad.write_text("from tests.engine.test_equivalence import x\nimport conftest\nfrom aiohttp.test_utils import y\n")
    assert [n for n in _imported_modules(bad) if _is_test_module(n)] == ["tests.engine.test_equivalence", "conftest"]


def test_no_two_test_modules_share_a_name():
    """Test folders are not packages, so pytest imports each test module by its file name: a
    second file of the same name elsewhere stops the whole collection ("import file mismatch")."""
    by_name: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" not in path.parts:
            by_name.setdefault(path.name, []).append(str(path.relative_to(TESTS.parent)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, clashes
