"""The READ of a hand-over's missing blocks, tried `DecodeConfig.transfer_attempts` times, each
in a `pdserve.kv_transfer` span; the producer is told with the `pulled` notice on the READ that
succeeds. What the consumer does when none does (recompute the prompt) is its own."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.decode_worker.decode_config import DecodeConfig
from pdserve.kv_transfer.notice import pulled_notice
from pdserve.kv_transfer.transport import KvTransferError, KvTransport, TransferStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadOutcome:
    """The last attempt's stats (None: every attempt failed) and how many attempts failed."""

    stats: TransferStats | None
    failures: int


def read_with_retries(
    agent: KvTransport, tracer: trace.Tracer, parent: Context, config: DecodeConfig, source_agent: str,
    remote: list[int], local: list[int], request_id: str,
) -> ReadOutcome:
    """READ `remote` blocks of `source_agent` into `local` blocks, retrying a failed READ."""
    failures = 0
    for attempt in range(1, config.transfer_attempts + 1):
        with tracer.start_span(
            "pdserve.kv_transfer", context=parent, record_exception=False, set_status_on_exception=False,
            attributes={"pdserve.attempt": attempt, "pdserve.blocks": len(remote), "pdserve.source": source_agent},
        ) as xfer:
            try:
                stats = agent.read(source_agent, remote, local, pulled_notice(request_id), config.transfer_timeout_s)
            except KvTransferError as exc:
                failures += 1
                xfer.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                log.warning("KV transfer for %s failed (attempt %d): %s", request_id, attempt, exc)
                continue
            xfer.set_attributes(
                {"pdserve.bytes": stats.num_bytes, "pdserve.descriptors": stats.num_descriptors, "pdserve.gbps": stats.gbps}
            )
            return ReadOutcome(stats, failures)
    return ReadOutcome(None, failures)
