"""The line of hand-overs waiting for free KV blocks on a decode worker (`decode_worker.room_waiters`)."""

from __future__ import annotations

from pdserve.decode_worker.room_waiters import RoomWaiters


def test_only_the_oldest_waiter_is_woken_and_only_when_room_grew() -> None:
    room = RoomWaiters()
    first = room.join("a", available=3)
    second = room.join("b", available=3)
    room.on_tick(3)  # no more room than when it failed
    assert not first.woken.is_set() and not second.woken.is_set()
    room.on_tick(5)
    assert first.woken.is_set() and not second.woken.is_set()
    assert room.is_first(first) and not room.is_first(second)


def test_a_retry_that_fails_again_keeps_its_place_and_waits_for_more() -> None:
    room = RoomWaiters()
    first = room.join("a", available=3)
    second = room.join("b", available=3)
    room.on_tick(5)
    room.failed_again(first, available=5)  # 5 were not enough for it
    assert not first.woken.is_set() and room.is_first(first)
    room.on_tick(5)
    assert not first.woken.is_set()
    room.on_tick(6)
    assert first.woken.is_set() and not second.woken.is_set()


def test_the_next_in_line_moves_up_when_the_first_leaves() -> None:
    room = RoomWaiters()
    first = room.join("a", available=0)
    second = room.join("b", available=0)
    room.leave(first)
    assert room.is_first(second) and len(room) == 1
    room.on_tick(1)
    assert second.woken.is_set()
    room.leave(first)  # leaving twice is harmless
    room.leave(second)
    assert len(room) == 0
    room.on_tick(10)  # nobody to wake


def test_wake_all_ends_every_wait() -> None:
    room = RoomWaiters()
    waiters = [room.join(str(i), available=0) for i in range(3)]
    room.wake_all()
    assert all(w.woken.is_set() for w in waiters)
