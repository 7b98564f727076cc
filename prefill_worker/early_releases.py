"""Requests released before their prefill call arrived: without a record, the late prefill
would be computed for nobody and its KV pinned until the lease ends, so an overload would keep
the worker busy with abandoned work long after it ended (`pdserve.worker.early_ends`)."""

from __future__ import annotations

from pdserve.worker.early_ends import EarlyEnds


class EarlyReleases(EarlyEnds):
    """The prefill worker's releases that found nothing; `take` tells the late prefill to stop."""
