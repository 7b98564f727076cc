"""The workers the router places on: their handles, each pool's placement state and
membership, and how many requests each still serves (what draining waits for)."""

from __future__ import annotations

import asyncio
import time

from pdserve.router.handles import DecodeHandle, PrefillHandle, RouterError
from pdserve.router.membership import PoolMembership
from pdserve.router.placement.pool_state import DecodePolicy, PrefillPolicy
from pdserve.router.router_config import RouterConfig


class WorkerPools:
    """The workers the router places on: their handles, each pool's placement policy and membership,
    and how many requests each worker still serves (what `drain` waits for)."""
    def __init__(self, config: RouterConfig, prefills: list[PrefillHandle], decodes: list[DecodeHandle]) -> None:
        self.prefills = {p.worker_id: p for p in prefills}
        self.decodes = {d.worker_id: d for d in decodes}
        bs = config.block_size
        self.prefill_policy = PrefillPolicy(config.placement, self.prefills, bs)
        self.decode_policy = DecodePolicy(config.placement, self.decodes, bs)
        self.prefill_members = PoolMembership("prefill", self.prefill_policy, config.membership)
        self.decode_members = PoolMembership("decode", self.decode_policy, config.membership)
        self._busy: dict[str, int] = {}  # requests a worker still serves

    def start(self) -> None:
        for p in self.prefills.values():
            self._watch(self.prefill_members, p)
        for d in self.decodes.values():
            self._watch(self.decode_members, d)

    async def stop(self) -> None:
        await self.prefill_members.stop()
        await self.decode_members.stop()

    @staticmethod
    def _watch(members: PoolMembership, handle: PrefillHandle | DecodeHandle) -> None:
        fetch = getattr(handle, "kv_events", None)
        if fetch is not None:  # a handle without KV events is placed by ring and load alone
            members.watch(handle.worker_id, fetch)

    def add_prefill(self, handle: PrefillHandle) -> None:
        """A new prefill worker joins: it takes over about 1/N of the ring's keys."""
        self.prefills[handle.worker_id] = handle
        self.prefill_policy.add_worker(handle.worker_id)
        self._watch(self.prefill_members, handle)

    def add_decode(self, handle: DecodeHandle) -> None:
        self.decodes[handle.worker_id] = handle
        self.decode_policy.add_worker(handle.worker_id)
        self._watch(self.decode_members, handle)

    async def drain(self, worker_id: str, timeout_s: float) -> bool:
        """Take a worker out of placement (its keys move to their next owners) and wait up to
        timeout_s for the requests it serves to finish. True if they did; `forget` it then."""
        members = self.prefill_members if worker_id in self.prefills else self.decode_members
        self.prefill_policy.remove_worker(worker_id)
        self.decode_policy.remove_worker(worker_id)
        await members.unwatch(worker_id)
        deadline = time.monotonic() + timeout_s
        while self._busy.get(worker_id, 0) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._busy.get(worker_id, 0) == 0

    def forget(self, worker_id: str) -> None:
        self.prefills.pop(worker_id, None)
        self.decodes.pop(worker_id, None)

    @property
    def down(self) -> set[str]:
        """Workers out of placement because they stopped answering."""
        return self.prefill_members.down | self.decode_members.down

    def busy(self, worker: str) -> int:
        """Requests `worker` still serves (a prefill worker's until their KV is pulled)."""
        return self._busy.get(worker, 0)

    def hold(self, worker: str) -> None:
        """One more request counts `worker` as its own (`InFlight.hold`)."""
        self._busy[worker] = self._busy.get(worker, 0) + 1

    def let_go(self, worker: str) -> None:
        self._busy[worker] -= 1

    def worker_failed(self, worker: str, exc: RouterError) -> None:
        """`worker` failed a call: it leaves placement until its health check answers again."""
        members = self.prefill_members if worker in self.prefills else self.decode_members
        members.report_failure(worker, exc.message)
