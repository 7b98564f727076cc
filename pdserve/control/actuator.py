"""Where the policy's decisions take effect. The simulator implements it now; the live cluster
will implement it with the in-place role flip (docs/controller.md, "The flip protocol", not
built yet): stop placing on the worker (an epoch makes late placements fail cleanly), drain,
switch role keeping weights, KV pool and prefix cache, pass a probe, rejoin the other pool.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.control.signals import Role


class Actuator(Protocol):
    def pick(self, donor: Role) -> str | None:
        """The worker of the donor pool to flip (the cheapest to drain); None if none can go."""

    def flip(self, worker: str, to: Role) -> None:
        """Start flipping `worker` to `to`; returns at once. The worker leaves placement now
        and rejoins the other pool when its probe passes; a failed flip leaves it out and
        unhealthy."""

    def in_flight(self) -> bool:
        """Whether a flip is draining, switching or probing (the policy allows one at a time)."""
