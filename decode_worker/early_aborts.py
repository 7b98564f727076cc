"""Requests aborted before the call that puts them on this decode worker (`start`, `submit`,
`prefetch`) arrived: without a record, the late call would import or prefill the request and
decode it to its last token for nobody, a load the router no longer counts
(`pdserve.worker.early_ends`)."""

from __future__ import annotations

from pdserve.worker.early_ends import EarlyEnds


class RequestAborted(RuntimeError):
    """A call for a request its router aborted before the call arrived."""


class EarlyAborts(EarlyEnds):
    """The decode worker's aborts that found nothing; `refuse` turns the late call away."""

    def refuse(self, request_id: str) -> None:
        """Raise RequestAborted if `request_id` was aborted before it arrived (the record goes)."""
        if self.take(request_id):
            raise RequestAborted(f"request {request_id} was aborted before it reached this worker")
