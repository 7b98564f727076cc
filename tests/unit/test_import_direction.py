"""Imports follow the request's direction: client -> router -> prefill -> kv_transfer -> decode.

Each first-party module may import only the first-party packages listed for its part
(docs/architecture.md has the table). Checked on the source with `ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FIRST_PARTY = ("pdserve", "pdserve_proto", "prefill_worker", "decode_worker", "kv_transfer", "router")

# part -> first-party prefixes it may import (its own prefix is always allowed)
ALLOWED: dict[str, tuple[str, ...]] = {
    "pdserve.engine": (),
    # Model acquisition (names, the default model, GGUF conversion): reads model configs only.
    "pdserve.models": ("pdserve.engine.config",),
    # Tracing and metrics: a leaf every part may import (it imports no first-party code).
    "pdserve.telemetry": (),
    "pdserve_proto": (),
    # The data path speaks plain layout numbers and the handle: nothing of the engine.
    "kv_transfer": ("pdserve_proto",),
    # What both worker roles share (engine loop, KV events, health, stats): nothing of a role.
    "pdserve.worker": ("pdserve.engine", "pdserve_proto", "pdserve.telemetry"),
    "prefill_worker": ("pdserve.worker", "pdserve.engine", "kv_transfer", "pdserve_proto", "pdserve.telemetry"),
    "decode_worker": ("pdserve.worker", "pdserve.engine", "kv_transfer", "pdserve_proto", "pdserve.telemetry"),
    # No worker package, and of the engine only what the edge needs: prompts are hashed as the
    # workers hash them, text is made from tokens, and requests carry sampling params.
    "router": (
        "pdserve.engine.hashing", "pdserve.engine.detokenizer", "pdserve.engine.sampling_params",
        "pdserve_proto", "pdserve.telemetry",
    ),
    "pdserve.cluster": (
        "pdserve.engine", "pdserve.models", "router", "prefill_worker", "decode_worker", "kv_transfer",
        "pdserve_proto", "pdserve.telemetry", "pdserve.control",  # the live P:D controller and its role flips
    ),
    "pdserve.llm": ("pdserve.engine", "pdserve.models"),
    # The P:D controller and its simulator: the router's placement policies (driven as the
    # router drives them) and prompt hashing; nothing of the workers, Ray or gRPC.
    "pdserve.control": ("router.placement", "pdserve.engine.hashing"),
    "pdserve": ("pdserve",),  # the CLI and package root may use everything under pdserve
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
    return ".".join(parts)


def may_import(module: str, imported: str) -> bool:
    part = part_of(module)
    allowed = FIRST_PARTY if part == "pdserve" else ALLOWED[part] + (part,)
    return any(imported == a or imported.startswith(a + ".") for a in allowed)


def test_imports_follow_the_request_direction():
    violations = []
    files = [p for top in FIRST_PARTY for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]
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
        ("router.router", "prefill_worker.prefiller"),  # the router reaches workers through handles only
        ("router.token_relay", "decode_worker.decoder"),
        ("router.membership", "pdserve.engine.block_manager"),  # KV events arrive as worker.proto messages
        ("router.edge.parsing", "pdserve.engine.engine"),
        ("kv_transfer.compat", "pdserve.engine.config"),  # layouts are plain numbers
        ("kv_transfer.agent", "pdserve.engine.hashing"),
        ("prefill_worker.prefiller", "decode_worker.decoder"),  # the two roles never import each other
        ("decode_worker.decoder", "prefill_worker.prefiller"),
        ("pdserve.worker.base", "decode_worker.kv_consumer"),  # the shared base knows no role
        ("pdserve.engine.engine", "pdserve.worker.engine_loop"),  # the engine knows nothing of workers
        ("pdserve.engine.engine", "pdserve.models.resolve"),  # the engine takes a resolved model
        ("pdserve.engine.scheduler", "router.router"),
    ],
)
def test_the_rules_forbid_the_backward_edges(module, imported):
    assert not may_import(module, imported)


# The router's worker client speaks worker.proto only: errors cross as `WorkerError` codes, never
# as the engine's or a worker's exception classes, so it imports nothing of either (nor of the
# worker-side adapter that turns those exceptions into codes).
WORKER_CLIENT = ("router/handles.py", "router/errors.py", "pdserve/cluster/worker_client.py")
WORKER_CLIENT_MAY_IMPORT = ("pdserve_proto", "pdserve.telemetry", "router.handles", "router.errors")


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
        "from decode_worker.early_aborts import RequestAborted\n"
        "from prefill_worker.prefiller import PrefillCancelled\n"
        "from pdserve.cluster.worker_host import WrongRole\n"
        "from pdserve_proto import worker_pb2\n"
    )
    allowed = [i for i in first_party_imports(bad) if _within(i, WORKER_CLIENT_MAY_IMPORT)]
    assert allowed == ["pdserve_proto"]


def test_the_checker_catches_a_backwards_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from router.server import serve\nimport pdserve.engine.model\n")
    assert first_party_imports(bad) == ["router.server", "pdserve.engine.model"]
    assert part_of("pdserve.engine.model") == "pdserve.engine"
    assert not any("router".startswith(a) for a in ALLOWED["pdserve.engine"])
