"""The unit tests' shared fixture: each test leaves the process's environment as it found it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """`pdserve serve` run in-process (to check how it refuses a flag) sets Ray's environment for a
    Ray instance of its own first: a token path under a temporary folder that is gone once the
    command ends. Left set, it made every later Ray start in the same test process fail (its GCS
    exits on the missing token file), so a cluster test run after the unit tests timed out."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
