"""A decode worker's settings (frozen: one per worker, carried whole)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeConfig:
    """A decode worker's settings: the KV READ's deadline and retries, the checksum check, the
    routers' lease, and how long a prefetch or a hand-over waiting for blocks may last."""

    transfer_timeout_s: float = 10.0
    transfer_attempts: int = 2  # then recompute the prompt locally
    kv_checksum: bool = True  # check pulled blocks against the handle's checksums (when it has them)
    # A router that neither polls nor starts a request for this long is taken for dead: its
    # requests are aborted and their blocks freed. It polls every few tens of milliseconds.
    router_lease_s: float = 15.0
    # A prefetch (`--kv-transfer-overlap`) that no `start` claims within this long is given up,
    # its blocks freed: longer than any prefill the router waits for.
    prefetch_timeout_s: float = 120.0
    # A hand-over that finds the KV pool full waits in line this long at most for blocks to
    # free (bounded also by the prefill worker's lease), before the router is told to retry.
    handover_wait_s: float = 2.0
