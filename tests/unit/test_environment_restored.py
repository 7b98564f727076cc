"""tests/unit/conftest.py's fixture: a variable a test sets without monkeypatch (as `pdserve serve`
run in-process sets Ray's) is gone for the next test. The two tests run in file order."""

from __future__ import annotations

import os

NAME = "PDSERVE_TEST_LEFT_BEHIND"


def test_a_test_that_sets_a_variable_and_leaves_it():
    assert NAME not in os.environ
    os.environ[NAME] = "/a/folder/that/is/gone"


def test_the_next_test_does_not_see_it():
    assert NAME not in os.environ
