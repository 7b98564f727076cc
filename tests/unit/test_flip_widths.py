"""Role flips between pools of different tensor-parallel widths are refused: a worker keeps its
width when it flips, and a pool counts workers of its own width. The controller's pick finds no
worker to flip; a flip asked by hand is refused naming the field, before anything moves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.cluster.role_flip import FlipConfig, FlipRefused, RoleFlipper
from pdserve.control.signals import Role


class _NoHosts:
    """A flip that got past the checks would call these: none may."""

    async def switch(self, worker_id, role, timeout_s):
        raise AssertionError("a refused flip reached the worker")

    async def link(self, worker_id, role, timeout_s):
        raise AssertionError("a refused flip reached the worker")

    def client(self, worker_id):
        raise AssertionError("a refused flip reached the worker")


def _flipper(prefill_width: int, decode_width: int) -> RoleFlipper:
    pools = SimpleNamespace(prefills={"prefill-0": object(), "prefill-1": object()},
                            decodes={"decode-0": object(), "decode-1": object()}, busy=lambda w: 0)
    cfg = FlipConfig(prefill_width=prefill_width, decode_width=decode_width)
    return RoleFlipper(SimpleNamespace(pools=pools), _NoHosts(), cfg)


def test_equal_widths_may_flip():
    assert FlipConfig(prefill_width=2, decode_width=2).width_refusal() is None
    flipper = _flipper(2, 2)
    assert flipper.pick(Role.PREFILL) == "prefill-0" and flipper.pick(Role.DECODE) == "decode-0"


@pytest.mark.parametrize("widths", [(2, 1), (1, 2)])
def test_different_widths_are_refused_naming_the_field(widths):
    flipper = _flipper(*widths)
    assert flipper.pick(Role.PREFILL) is None and flipper.pick(Role.DECODE) is None
    with pytest.raises(FlipRefused, match=rf"^role: the prefill pool's workers span {widths[0]} ranks and the decode pool's {widths[1]}"):
        asyncio.run(flipper.change("prefill-1", "decode"))
    assert flipper.changes == []
