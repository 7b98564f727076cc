"""The invariants around a router's death (pure): what a request sent to the dead router may end
with, and that a request sent to the other router gets no such excuse."""

from __future__ import annotations

import pytest

from tests.faults.invariants import Outcome, Reference, check_outcome
from tests.faults.scenarios import NORMAL_DEADLINE_S, ROUTER_DIES, Fault, RequestSpec, Scenario, router_of

REF = Reference(token_ids=(5, 6, 7, 8), text="abcd", finish_reason="length")


def _request(deadline_s: float = NORMAL_DEADLINE_S) -> RequestSpec:
    return RequestSpec(
        prompt=(1, 2, 3), max_tokens=4, ignore_eos=True, temperature=0.0, seed=None, start_s=0.0, deadline_s=deadline_s
    )


def _scenario(tight_victim: bool = False) -> Scenario:
    """Request 0 goes to the router that dies, request 1 to the other."""
    assert router_of(0) != router_of(1)
    requests = (_request(0.5 if tight_victim else NORMAL_DEADLINE_S), _request())
    return Scenario(0, requests, (Fault(ROUTER_DIES, victim=0, point="mid_stream", at=2, lease_s=3.0),))


def _ended(code: str, tokens: int, details: str = "Cancelling all calls") -> Outcome:
    return Outcome(
        token_ids=list(REF.token_ids[:tokens]),
        text=REF.text[:tokens],
        chunk_sizes=[1] * tokens,
        code=code,
        details=details,
        wall_s=0.1,
    )


def test_a_request_on_the_dead_router_may_end_unavailable_with_a_prefix_of_its_tokens():
    assert check_outcome(_scenario(), 0, _ended("UNAVAILABLE", 2), REF) == []


def test_a_request_on_the_dead_router_that_finished_first_has_exact_tokens():
    out = _ended("OK", 4, "")
    out.finish_reason, out.completion_tokens = "length", 4
    assert check_outcome(_scenario(), 0, out, REF) == []
    out.finish_reason = "abort"  # cut short, yet OK: caught
    assert any("finish_reason" in v for v in check_outcome(_scenario(), 0, out, REF))


def test_a_request_on_the_dead_router_ends_nothing_but_unavailable():
    for code in ("DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL"):
        bad = check_outcome(_scenario(), 0, _ended(code, 2), REF)
        assert any("its router died" in v for v in bad), (code, bad)
    # A deadline it could miss anyway may end it first.
    assert check_outcome(_scenario(tight_victim=True), 0, _ended("DEADLINE_EXCEEDED", 2), REF) == []


def test_a_request_on_the_surviving_router_may_not_fail():
    bad = check_outcome(_scenario(), 1, _ended("UNAVAILABLE", 2), REF)
    assert any("failed UNAVAILABLE" in v for v in bad), bad


def test_a_token_wrong_after_the_death_is_caught():
    out = _ended("UNAVAILABLE", 2)
    out.token_ids[1] = 99
    assert any("not a prefix" in v for v in check_outcome(_scenario(), 0, out, REF))


def _ended_before_the_death(code: str, details: str) -> Outcome:
    out = _ended(code, 1, details)
    out.ended_before_its_router_died = True
    return out


def test_a_request_its_router_ended_before_dying_is_judged_as_on_a_live_router():
    """Seed 561: a request on the router that died later had ended DEADLINE_EXCEEDED before,
    its KV lease (shortened by a dropped READ) gone: excused by that, not by the death."""
    lease = "decode start: timed out (lease_deadline: only 0.0s left on the KV lease of r0)"
    excused = _scenario()
    excused = Scenario(0, excused.requests, (*excused.faults, Fault("transfer_dropped", victim=0, count=1, lease_s=0.31)))
    assert check_outcome(excused, 0, _ended_before_the_death("DEADLINE_EXCEEDED", lease), REF) == []
    # Nothing but the death to excuse it: caught, whatever status the router gave.
    for code in ("DEADLINE_EXCEEDED", "UNAVAILABLE"):
        bad = check_outcome(_scenario(), 0, _ended_before_the_death(code, "decode: no decode worker"), REF)
        assert any("before its router died" in v for v in bad), (code, bad)


@pytest.mark.parametrize(
    "lost",
    [
        "Stream removed (recvmsg:Connection reset by peer (104))",
        "Socket closed",
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused",
        "Cancelling all calls",
    ],
)
def test_a_status_the_routers_death_overtook_is_unavailable(lost):
    """The router had ended the request, but died before its status reached the client: the
    client sees the lost connection's UNAVAILABLE, which says nothing about the router's answer."""
    assert check_outcome(_scenario(), 0, _ended_before_the_death("UNAVAILABLE", lost), REF) == []
    # A request of the router that is still alive gets no such pass.
    bad = check_outcome(_scenario(), 1, _ended_before_the_death("UNAVAILABLE", lost), REF)
    assert any("failed UNAVAILABLE" in v for v in bad), bad
    # Nor does an UNAVAILABLE in the router's own words.
    bad = check_outcome(_scenario(), 0, _ended_before_the_death("UNAVAILABLE", "decode: no decode worker"), REF)
    assert any("before its router died" in v for v in bad), bad
