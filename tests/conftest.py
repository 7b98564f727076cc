"""Shared fixtures: tiny random models of every supported architecture, built with transformers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_model

# Tests never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Test clusters stay on loopback, as `pdserve serve` keeps a local cluster: Ray reads this once,
# when it is imported (docs/security.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, object]]:
    cache: dict[str, tuple[Path, object]] = {}

    def make(arch: str) -> tuple[Path, object]:
        if arch not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[arch] = (d, build_tiny_model(arch, d))
        return cache[arch]

    return make


@pytest.fixture
def check_blocks_freed() -> Iterator[Callable]:
    """Register engines; after the test every KV block of each must be free or cached."""
    engines: list = []
    yield engines.append
    for engine in engines:
        stats = engine.blocks.check_integrity()  # the whole accounting, not only the counts
        assert stats.in_use == 0, f"KV blocks still in use after the test: {stats}"
