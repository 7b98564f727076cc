"""At start-up, the two pools' workers connect to each other (each decode worker to each prefill
worker and back), and each decode worker started now READs from each prefill worker once: the
link self-test, whose rate goes to the start-up lines and to
`pdserve_kv_link_test_bytes_per_second`. An adopted decode worker is not tested: it serves, and
the test would write into blocks in use."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from typing import Any

from pdserve.cluster.startup_lines import Progress, worker_ready_line
from pdserve.router.deadline import within
from pdserve_proto import kv_pb2

log = logging.getLogger(__name__)

LINK_TIMEOUT_S = 60.0


async def link_pools(
    prefills: Sequence[Any], p_infos: Sequence[kv_pb2.KvAgentInfo], decodes: Sequence[Any],
    d_infos: Sequence[kv_pb2.KvAgentInfo], started: Collection[str], link_gauge: Any, progress: Progress,
) -> None:
    """Connect the pools' actors both ways, test the new decode workers' links, and report
    each worker ready. Colocated (no prefill pool): nothing to link or test."""
    for pi in p_infos:
        progress(worker_ready_line("prefill", pi, ()))
    links = [d.connect.remote(pi) for d in decodes for pi in p_infos]
    links += [p.connect.remote(di) for p in prefills for di in d_infos]
    await within(asyncio.gather(*links), LINK_TIMEOUT_S)
    for d, di in zip(decodes, d_infos):
        measured = []
        for pi in p_infos if di.worker_id in started else ():
            gbps = await within(d.link_test.remote(pi.agent_name), LINK_TIMEOUT_S)
            log.info("KV link %s <- %s: %.2f GB/s", di.worker_id, pi.worker_id, gbps)
            link_gauge.labels(di.worker_id, pi.worker_id).set(gbps * 1e9)
            measured.append((pi.worker_id, gbps))
        progress(worker_ready_line("decode", di, measured))
