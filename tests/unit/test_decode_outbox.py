"""A decode worker's per-router outboxes and router leases (`decode_worker.outbox`), on a fake clock."""

from __future__ import annotations

import pytest

from pdserve.decode_worker.outbox import MAX_EXPIRED_ROUTERS, RouterOutboxes
from pdserve_proto.worker_pb2 import TokenUpdate


def _u(rid: str, *tokens: int, reason: str = "") -> TokenUpdate:
    return TokenUpdate(request_id=rid, token_ids=list(tokens), finish_reason=reason)


def test_each_router_takes_only_its_own_requests_updates():
    boxes = RouterOutboxes(lease_s=15)
    boxes.register("a", "r1", now=0)
    boxes.register("b", "r2", now=0)
    assert boxes.deliver([_u("r1", 1), _u("r2", 2), _u("r1", 3)])
    assert [(u.request_id, list(u.token_ids)) for u in boxes.take("b")] == [("r2", [2])]
    assert [(u.request_id, list(u.token_ids)) for u in boxes.take("a")] == [("r1", [1]), ("r1", [3])]
    assert boxes.take("a") == [] and not boxes.has("b")


def test_a_finished_request_leaves_its_router_and_later_updates_of_it_are_dropped():
    boxes = RouterOutboxes(lease_s=15)
    boxes.register("a", "r1", now=0)
    boxes.deliver([_u("r1", 7, reason="length")])
    assert boxes.owner("r1") is None
    assert not boxes.deliver([_u("r1", 8), _u("nobody", 9)])
    assert [u.finish_reason for u in boxes.take("a")] == ["length"]


def test_a_router_silent_for_its_lease_loses_its_requests_and_no_other_router_does():
    boxes = RouterOutboxes(lease_s=10)
    boxes.register("a", "r1", now=0)
    boxes.register("a", "r2", now=1)
    boxes.register("b", "r3", now=1)
    boxes.touch("b", now=9)
    assert boxes.expire(now=10.5) == []  # a's lease runs from its last start, at 1
    assert sorted(boxes.expire(now=11)) == ["r1", "r2"]
    assert boxes.routers() == ["b"] and boxes.expiries == 1
    assert boxes.owner("r3") == "b" and boxes.owner("r1") is None
    assert boxes.expire(now=18) == []  # b polled at 9
    assert boxes.expire(now=19) == ["r3"]


def test_polling_renews_the_lease():
    boxes = RouterOutboxes(lease_s=10)
    boxes.register("a", "r1", now=0)
    for t in range(5, 100, 5):
        boxes.touch("a", now=t)
        assert boxes.expire(now=t + 9.9) == []
    assert boxes.owner("r1") == "a"


def test_a_router_that_polls_after_its_lease_ran_out_finds_its_requests_aborted():
    boxes = RouterOutboxes(lease_s=10)
    boxes.register("a", "r1", now=0)
    boxes.deliver([_u("r1", 1)])
    assert boxes.expire(now=10) == ["r1"]
    boxes.touch("a", now=30)  # it was only stalled
    assert [(u.request_id, list(u.token_ids), u.finish_reason) for u in boxes.take("a")] == [("r1", [], "abort")]
    assert boxes.routers() == ["a"]  # a lease again


def test_expired_routers_outboxes_are_bounded():
    boxes = RouterOutboxes(lease_s=1)
    for i in range(MAX_EXPIRED_ROUTERS + 5):
        boxes.register(f"router-{i}", f"r{i}", now=i)
        boxes.expire(now=i + 1)
    assert not boxes.has("router-0")  # the oldest expired outboxes are gone
    assert boxes.has(f"router-{MAX_EXPIRED_ROUTERS + 4}")


def test_forget_drops_an_aborted_request():
    boxes = RouterOutboxes(lease_s=10)
    boxes.register("a", "r1", now=0)
    boxes.forget("r1")
    assert boxes.expire(now=20) == []


def test_the_lease_must_be_positive():
    with pytest.raises(ValueError, match="lease_s"):
        RouterOutboxes(lease_s=0)


def test_updates_stay_until_acknowledged_so_a_lost_answer_is_sent_again():
    box = RouterOutboxes(lease_s=10.0)
    box.register("r", "a", now=0.0)
    box.deliver([TokenUpdate(request_id="a", token_ids=[1]), TokenUpdate(request_id="a", token_ids=[2])])
    first = box.take("r", acked=0)
    assert [(u.seq, list(u.token_ids)) for u in first] == [(1, [1]), (2, [2])]
    # That answer never reached the router: it polls again with what it had, and gets both again.
    assert [u.seq for u in box.take("r", acked=0)] == [1, 2]
    box.deliver([TokenUpdate(request_id="a", token_ids=[3], finish_reason="length")])
    assert box.has("r", acked=2) and not box.has("r", acked=3)
    assert [(u.seq, u.finish_reason) for u in box.take("r", acked=2)] == [(3, "length")]
    assert box.take("r", acked=3) == [] and not box.has("r")  # acknowledged: dropped


def test_numbers_go_on_per_router_and_a_poll_without_acked_takes_everything():
    box = RouterOutboxes(lease_s=10.0)
    box.register("r1", "a", now=0.0)
    box.register("r2", "b", now=0.0)
    box.deliver([TokenUpdate(request_id="b", token_ids=[9]), TokenUpdate(request_id="a", token_ids=[1])])
    assert [u.seq for u in box.take("r1")] == [1] and box.take("r1") == []
    assert [u.seq for u in box.take("r2", acked=0)] == [1]
