"""Closed loops that drive the controller's policy interval by interval (flips only, or flips
with adds and removals), shared by the policy tests."""

from __future__ import annotations

from dataclasses import replace

from pdserve.control.controller import Controller
from pdserve.control.signals import Role
from tests.unit.controller_load import MODEL, signals


def run_flips(ctrl: Controller, p: int, d: int, load, intervals: int, start: float = 0.0):
    """Decide every interval, applying each flip at once (the flip time is in the interval)."""
    flips, t = [], start
    for i in range(intervals):
        dec = ctrl.decide(signals(t, p, d, *load(i)), MODEL)
        if dec.action == "flip":
            flips.append((i, dec.flip_from))
            k = dec.count
            p, d = (p - k, d + k) if dec.flip_from is Role.PREFILL else (p + k, d - k)
        t += ctrl.interval_s
    return p, d, flips


def run_scaling(ctrl: Controller, p: int, d: int, load, intervals: int):
    """Decide every interval; flips and removals apply at once, an add (of the difference to its
    target split) after its start time. Returns the pools at the end, the changes [(interval,
    action, pool, count)] and the most workers held."""
    changes, starting, most, t = [], None, p + d, 0.0
    for i in range(intervals):
        if starting is not None and t >= starting[0]:
            p, d = p + starting[1], d + starting[2]
            starting = None
        held = p + d + (0 if starting is None else starting[1] + starting[2])
        most = max(most, held)
        s = replace(signals(t, p, d, *load(i), in_flight=starting is not None), total_workers=held)
        dec = ctrl.decide(s, MODEL)
        if dec.action == "flip":
            k = dec.count
            p, d = (p - k, d + k) if dec.flip_from is Role.PREFILL else (p + k, d - k)
            changes.append((i, "flip", dec.flip_from, k))
        elif dec.action == "add":
            kp, kd = dec.target_prefill - p, dec.target_decode - d
            assert kp >= 0 and kd >= 0 and kp + kd == dec.count >= 1
            starting = (t + ctrl.start_s, kp, kd)
            changes.append((i, "add", dec.pool, dec.count))
        elif dec.action == "remove":
            p, d = (p - 1, d) if dec.pool is Role.PREFILL else (p, d - 1)
            changes.append((i, "remove", dec.pool, 1))
        t += ctrl.interval_s
    return p, d, changes, most
