"""The simulator's actuator: where the controller's decisions take effect, as the flip protocol
and the scaler do live. A flip takes the worker out of placement, drains it (decode streams
still running at the deadline resume on other workers), switches it (the model's flip_s) and
has it join the other pool; an add joins a new worker after the model's start_s; a removal
drains it and it leaves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.control.signals import Decision, Role
from pdserve.control.sim_workers import SimDecode

if TYPE_CHECKING:  # the simulator owns the actuator: a reference for types only
    from pdserve.control.simulator import Simulation


class SimActuator:
    """The changes in flight (draining, switching, starting, leaving) and the flips made."""

    def __init__(self, sim: Simulation, first_name: int) -> None:
        self.sim = sim
        self.draining: dict[str, tuple[Role, float]] = {}  # worker -> (role it leaves, drain start)
        self.switching: set[str] = set()
        self.starting: dict[str, Role] = {}  # added workers until their start is done
        self.removing: set[str] = set()  # draining to leave the cluster (not to flip)
        self.next_name = first_name
        self.flips: list[tuple[float, Role]] = []

    def apply(self, d: Decision, now: float) -> None:
        """Start what the decision asks for: adds, a removal or a flip of `count` workers."""
        if d.action == "add":  # the difference to the target split, started together
            for pool, k in ((Role.PREFILL, d.target_prefill - d.prefill), (Role.DECODE, d.target_decode - d.decode)):
                for _ in range(k):
                    self.add(pool, now)
        if d.action == "remove" and d.pool is not None:
            w = self.pick(d.pool)
            if w is not None:
                self.retire(w, d.pool, now)
        if d.action == "flip" and d.flip_from is not None:
            for _ in range(d.count):
                w = self.pick(d.flip_from)
                if w is not None:
                    self.flip(w, d.flip_from.other, now)

    def in_flight(self) -> bool:
        """Whether a flip is draining or switching, or a worker starting (one change at a time)."""
        return bool(self.draining or self.switching or self.starting)

    def add(self, pool: Role, now: float) -> None:
        """A new worker joins `pool` cold once the model's start time has passed."""
        name = f"w{self.next_name}"
        self.next_name += 1
        self.starting[name] = pool
        self.sim.push(now + self.sim.model.start_s, "started", name)

    def started(self, name: str, now: float) -> None:
        """An added worker's start is done: it joins its pool, and the controller learns the time."""
        pool = self.starting.pop(name)
        self.sim.capacity.started(name)
        assert self.sim.ctrl is not None
        self.sim.ctrl.observe_start(self.sim.model.start_s)
        self.join(name, pool, now)

    def retire(self, name: str, pool: Role, now: float) -> None:
        """Out of placement now; drained as for a flip, then gone."""
        self.removing.add(name)
        self.flip(name, pool.other, now, record=False)

    def pick(self, donor: Role) -> str | None:
        """The worker of the donor pool cheapest to drain; None where it is the last one."""
        if donor is Role.PREFILL:
            cands = [(w.queued_tokens, n) for n, w in self.sim.prefill.items() if n not in self.draining]
        else:
            cands = [(w.reserved, n) for n, w in self.sim.decode.items() if n not in self.draining]
        return min(cands)[1] if len(cands) > 1 else None

    def flip(self, name: str, to: Role, now: float, record: bool = True) -> None:
        """Out of placement now; drained, then switched (flip_s), then in the other pool."""
        leaving = to.other
        self.draining[name] = (leaving, now)
        if record:
            self.flips.append((now, leaving))
        if leaving is Role.PREFILL:
            self.sim.pp.remove_worker(name)
            if self.sim.prefill[name].idle:
                self.drained(name, now)
        else:
            self.sim.dp.remove_worker(name)
            if not self.sim.decode[name].batch:
                self.drained(name, now)
            else:
                self.sim.push(now + self.sim.cfg.drain_deadline_s, "deadline", name)

    def deadline(self, name: str, now: float) -> None:
        """Streams still on a draining decode worker resume on another one (mid-stream resume)."""
        w = self.sim.decode.get(name)
        if w is None or name not in self.draining:
            return
        w.advance(now)
        for i in list(w.admitted):
            ctx = w.admitted[i][1] + int(w.v - w.admitted[i][0])
            left = w.remove(i)
            self.sim.placed.pop(i, None)
            self.sim.waiting.appendleft((i, ctx, left))
        self.drained(name, now)
        self.sim.admit(now)

    def drained(self, name: str, now: float) -> None:
        """Out of its pool: gone (a removal), or switching to the other role (a flip)."""
        leaving, _ = self.draining[name]
        (self.sim.prefill if leaving is Role.PREFILL else self.sim.decode).pop(name)
        if name in self.removing:  # it leaves the cluster
            self.removing.discard(name)
            self.draining.pop(name)
            self.sim.sample(now, None)
            return
        self.switching.add(name)
        self.sim.push(now + self.sim.model.flip_s, "switched", name)

    def switched(self, name: str, now: float) -> None:
        """A flip is done: the worker joins the other pool, and the controller learns the time."""
        leaving, started = self.draining.pop(name)
        self.switching.discard(name)
        self.sim.capacity.started(name)
        assert self.sim.ctrl is not None
        self.sim.ctrl.observe_flip(now - started)
        self.join(name, leaving.other, now)

    def join(self, name: str, pool: Role, now: float) -> None:
        """A worker (new, or flipped) enters `pool`'s placement."""
        if pool is Role.DECODE:
            self.sim.decode[name] = SimDecode(name, self.sim.model, now)
            self.sim.dp.add_worker(name)
            self.sim.admit(now)
        else:
            self.sim.prefill[name] = self.sim.new_prefill(name)
            self.sim.pp.add_worker(name)
        self.sim.sample(now, None)
