"""Imports follow the request's direction: client -> router -> prefill -> kv_transfer -> decode.

Each first-party module may import only the first-party packages listed for its part
(docs/architecture.md has the table). Checked on the source with `ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FIRST_PARTY = ("pdserve", "pdserve_proto")
# The repository's top-level folders and the package each installs as (pyproject's package-dir).
FOLDERS = {
    "pdserve": "pdserve", "pdserve_proto": "pdserve_proto", "router": "pdserve.router",
    "kv_transfer": "pdserve.kv_transfer", "prefill_worker": "pdserve.prefill_worker",
    "decode_worker": "pdserve.decode_worker",
}
# Their names before they moved under pdserve: a module imported under both names would be two
# modules, with two copies of every class (isinstance and except clauses would miss), so none may remain.
OLD_NAMES = ("router", "kv_transfer", "prefill_worker", "decode_worker")

# part -> first-party prefixes it may import (its own prefix is always allowed)
ALLOWED: dict[str, tuple[str, ...]] = {
    "pdserve.engine": (),
    # Model acquisition (names, the default model, GGUF conversion): reads model configs only.
    "pdserve.models": ("pdserve.engine.config",),
    # Tracing and metrics: a leaf every part may import (it imports no first-party code).
    "pdserve.telemetry": (),
    "pdserve_proto": (),
    # The data path speaks plain layout numbers and the handle: nothing of the engine.
    "pdserve.kv_transfer": ("pdserve_proto",),
    # What both worker roles share (engine loop, KV events, health, stats): nothing of a role.
    "pdserve.worker": ("pdserve.engine", "pdserve_proto", "pdserve.telemetry"),
    "pdserve.prefill_worker": (
        "pdserve.worker", "pdserve.engine", "pdserve.kv_transfer", "pdserve_proto", "pdserve.telemetry",
    ),
    "pdserve.decode_worker": (
        "pdserve.worker", "pdserve.engine", "pdserve.kv_transfer", "pdserve_proto", "pdserve.telemetry",
    ),
    # No worker package, and of the engine only what the edge needs: prompts are hashed as the
    # workers hash them, text is made from tokens, and requests carry sampling params.
    "pdserve.router": (
        "pdserve.engine.hashing", "pdserve.engine.detokenizer", "pdserve.engine.sampling_params",
        "pdserve_proto", "pdserve.telemetry",
    ),
    "pdserve.cluster": (
        "pdserve.engine", "pdserve.models", "pdserve.router", "pdserve.prefill_worker", "pdserve.decode_worker",
        "pdserve.kv_transfer",
        "pdserve_proto", "pdserve.telemetry", "pdserve.control",  # the live P:D controller and its role flips
    ),
    "pdserve.llm": ("pdserve.engine", "pdserve.models"),
    # The P:D controller and its simulator: the router's placement policies (driven as the
    # router drives them), prompt hashing and the engine's pacing of prompt chunks (`step_slack`,
    # driven as an engine drives it); nothing of the workers, Ray or gRPC.
    "pdserve.control": ("pdserve.router.placement", "pdserve.engine.hashing", "pdserve.engine.step_slack"),
    "pdserve": ("pdserve",),  # the CLI and package root may use everything first-party
}


def part_of(module: str) -> str:
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len)


def first_party_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] in FIRST_PARTY]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join((FOLDERS[parts[0]], *parts[1:]))


def may_import(module: str, imported: str) -> bool:
    part = part_of(module)
    allowed = FIRST_PARTY if part == "pdserve" else ALLOWED[part] + (part,)
    return any(imported == a or imported.startswith(a + ".") for a in allowed)


def test_imports_follow_the_request_direction():
    violations = []
    files = [p for top in FOLDERS for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]
    assert files, "no first-party sources found"
    for path in files:
        module = module_name(path)
        for imported in first_party_imports(path):
            if not may_import(module, imported):
                violations.append(f"{module} imports {imported} (part {part_of(module)!r} may not)")
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize(
    ("module", "imported"),
    [
        ("pdserve.router.router", "pdserve.prefill_worker.prefiller"),  # the router reaches workers by handles
        ("pdserve.router.token_relay", "pdserve.decode_worker.decoder"),
        ("pdserve.router.membership", "pdserve.engine.block_manager"),  # KV events arrive as worker.proto messages
        ("pdserve.router.edge.parsing", "pdserve.engine.engine"),
        ("pdserve.kv_transfer.compat", "pdserve.engine.config"),  # layouts are plain numbers
        ("pdserve.kv_transfer.agent", "pdserve.engine.hashing"),
        ("pdserve.prefill_worker.prefiller", "pdserve.decode_worker.decoder"),  # the roles never import each other
        ("pdserve.decode_worker.decoder", "pdserve.prefill_worker.prefiller"),
        ("pdserve.worker.base", "pdserve.decode_worker.kv_consumer"),  # the shared base knows no role
        ("pdserve.engine.engine", "pdserve.worker.engine_loop"),  # the engine knows nothing of workers
        ("pdserve.engine.engine", "pdserve.models.resolve"),  # the engine takes a resolved model
        ("pdserve.engine.scheduler", "pdserve.router.router"),
    ],
)
def test_the_rules_forbid_the_backward_edges(module, imported):
    assert not may_import(module, imported)


# The router's worker client speaks worker.proto only: errors cross as `WorkerError` codes, never
# as the engine's or a worker's exception classes, so it imports nothing of either (nor of the
# worker-side adapter that turns those exceptions into codes).
WORKER_CLIENT = ("router/handles.py", "router/errors.py", "pdserve/cluster/worker_client.py")
WORKER_CLIENT_MAY_IMPORT = ("pdserve_proto", "pdserve.telemetry", "pdserve.router.handles", "pdserve.router.errors")


def _within(imported: str, prefixes: tuple[str, ...]) -> bool:
    return any(imported == p or imported.startswith(p + ".") for p in prefixes)


def test_the_worker_client_imports_no_engine_or_worker_code():
    violations = [
        f"{rel} imports {imported}"
        for rel in WORKER_CLIENT
        for imported in first_party_imports(ROOT / rel)
        if not _within(imported, WORKER_CLIENT_MAY_IMPORT)
    ]
    assert not violations, "\n".join(violations)


def test_the_worker_client_rule_forbids_worker_exceptions(tmp_path):
    bad = tmp_path / "client.py"
    bad.write_text(
        "from pdserve.engine.block_manager import NoFreeBlocksError\n"
        "from pdserve.decode_worker.early_aborts import RequestAborted\n"
        "from pdserve.prefill_worker.prefiller import PrefillCancelled\n"
        "from pdserve.cluster.worker_host import WrongRole\n"
        "from pdserve_proto import worker_pb2\n"
    )
    allowed = [i for i in first_party_imports(bad) if _within(i, WORKER_CLIENT_MAY_IMPORT)]
    assert allowed == ["pdserve_proto"]


def test_the_checker_catches_a_backwards_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from pdserve.router.server import serve\nimport pdserve.engine.model\n")
    assert first_party_imports(bad) == ["pdserve.router.server", "pdserve.engine.model"]
    assert part_of("pdserve.engine.model") == "pdserve.engine"
    assert part_of("pdserve.router.edge.parsing") == "pdserve.router"
    assert not may_import("pdserve.engine.model", "pdserve.router.server")


def old_name_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Imports of a first-party package by its name before the move, and module paths naming one in
    the strings that import or patch by name (`import_module("router.x")`, `setattr("router.x.y", ...)`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(f"import {a.name}" for a in node.names if a.name.split(".")[0] in OLD_NAMES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in OLD_NAMES:
                found.append(f"from {node.module}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[0].value
            if func in ("import_module", "__import__", "setattr", "delattr", "patch", "find_spec") and (
                isinstance(arg, str) and arg.split(".")[0] in OLD_NAMES and "." in arg
            ):
                found.append(f"{func}({arg!r})")
    return [f"{path.relative_to(root)}:{use}" for use in found]


def _repository_py_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    return [ROOT / p for p in listed if (ROOT / p).is_file()]


def test_no_module_is_imported_by_its_old_top_level_name():
    files = _repository_py_files()
    assert any(p.parts[-2:] == ("router", "router.py") for p in files), "the listing missed the router"
    uses = [use for path in files for use in old_name_uses(path)]
    assert not uses, "import these as pdserve.<name>:\n" + "\n".join(uses)


def test_the_old_name_rule_catches_each_form(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "import router\nimport kv_transfer.agent as agent\nfrom decode_worker.decoder import DecodeWorker\n"
        "from prefill_worker import prefiller\nimport importlib\nimportlib.import_module('router.router')\n"
        "def t(monkeypatch):\n    monkeypatch.setattr('router.stats.time.monotonic', None)\n"
        "import pdserve.router.router\nfrom pdserve.kv_transfer import agent\nfrom . import router\n"
    )
    assert sorted(use.split(":", 1)[1] for use in old_name_uses(bad, root=tmp_path)) == sorted([
        "import router", "import kv_transfer.agent", "from decode_worker.decoder", "from prefill_worker",
        "import_module('router.router')", "setattr('router.stats.time.monotonic')",
    ])
