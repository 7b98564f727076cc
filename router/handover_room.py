"""A hand-over that waits for room: while the decode worker has no free KV blocks for a prompt,
the router tries the same hand-over again after a backoff, for as long as the prefill worker's
KV lease lasts."""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.router.failover import Failover
from pdserve.router.handles import RouterError
from pdserve.router.inflight import InFlight
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import worker_pb2

# A hand-over refused for want of free KV blocks is tried again after these waits (doubling).
HANDOVER_RETRY_FIRST_S = 0.01
HANDOVER_RETRY_MAX_S = 0.25


async def start_when_room(
    failover: Failover, metrics: RouterMetrics, r: InFlight, handle: worker_pb2.PrefillResult
) -> worker_pb2.DecodeStart:
    """The hand-over; while the decode worker has no free KV blocks for the prompt, the same
    hand-over again after a backoff, for as long as the prefill worker's lease keeps the KV
    (the worker itself first waits in line for blocks, `DecodeConfig.handover_wait_s`).
    An admitted request so waits its turn behind the ones decoding, as it would in the
    worker's queue, instead of failing after its first token reached the client."""
    delay = HANDOVER_RETRY_FIRST_S
    waited = 0.0
    while True:
        try:
            start = await failover.start(r, handle)
        except RouterError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            left = handle.handle.lease_deadline - time.time()
            if left <= delay:
                raise RouterError(
                    exc.code, f"{exc.message} (waited {waited:.1f}s for free blocks; the prefill worker's "
                    f"KV lease ends in {max(left, 0.0):.1f}s)",
                ) from exc
            if waited == 0.0:
                metrics.handover_waits.inc()
        else:
            if start.waited_for_blocks_s > 0 and waited == 0.0:  # it waited in line on the worker
                metrics.handover_waits.inc()
            return start
        await asyncio.sleep(delay)
        waited += delay
        delay = min(2 * delay, HANDOVER_RETRY_MAX_S)
