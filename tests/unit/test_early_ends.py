"""The workers' records of requests ended before the call that brings them arrived: a prefill
worker's releases (`prefill_worker.early_releases`), a decode worker's aborts
(`decode_worker.early_aborts`)."""

from __future__ import annotations

import pytest

from pdserve.decode_worker.early_aborts import EarlyAborts, RequestAborted
from pdserve.prefill_worker.early_releases import EarlyReleases


def test_a_recorded_release_is_taken_once():
    early = EarlyReleases()
    early.add("a")
    assert "a" in early and len(early) == 1
    assert early.take("a") is True
    assert early.take("a") is False and len(early) == 0
    assert early.take("never") is False


def test_a_recorded_abort_refuses_its_call_once():
    early = EarlyAborts()
    early.add("a")
    with pytest.raises(RequestAborted, match="request a was aborted before it reached this worker"):
        early.refuse("a")
    early.refuse("a")  # the record went with the refusal
    early.refuse("never")
    assert len(early) == 0


@pytest.mark.parametrize("records", [EarlyReleases, EarlyAborts])
def test_the_oldest_records_go_first_beyond_capacity(records):
    early = records(capacity=2)
    for rid in ("a", "b", "c"):
        early.add(rid)
    assert "a" not in early and "b" in early and "c" in early
    early.add("b")  # again: now the newest
    early.add("d")
    assert "c" not in early and "b" in early and "d" in early


@pytest.mark.parametrize("records", [EarlyReleases, EarlyAborts])
def test_capacity_must_be_positive(records):
    with pytest.raises(ValueError, match="capacity"):
        records(capacity=0)
