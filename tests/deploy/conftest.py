"""The chart under test, loaded once per session."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm
import pytest
from helm_objects import CHART_DIR


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as c:
        yield c
