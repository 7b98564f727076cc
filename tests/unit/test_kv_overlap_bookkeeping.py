"""`--kv-transfer-overlap`'s bookkeeping, without engines or transports: the progress notice's
format, what a prefill worker announces and lends (`prefill_worker.progress_book`), and a decode
worker's prefetch state (`decode_worker.prefetch`)."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.decode_worker.prefetch import Prefetch
from pdserve.engine.handover import ImportPlan
from pdserve.kv_transfer.notice import progress_notice, progress_of, pulled_notice, pulled_request
from pdserve.prefill_worker.progress_book import ProgressBook
from pdserve_proto import kv_pb2


def test_a_progress_notice_round_trips_and_is_told_apart_from_pulled():
    p = kv_pb2.KvProgress(request_id="r1", agent_name="prefill-0-ab", first_block=3, block_ids=[7, 8, 9])
    assert progress_of(progress_notice(p)) == p
    assert progress_of(pulled_notice("r1")) is None
    assert pulled_request(progress_notice(p)) is None
    assert progress_of(b"progress:\xff\xff\xff") is None  # garbled: ignored, the handle covers those blocks


def test_each_block_is_announced_once_and_lent_until_dropped():
    book = ProgressBook()
    book.follow("r", "decode-0-cd")
    assert book.advance("r", [], "p") is None
    first = book.advance("r", [10, 11], "p")
    assert (first.first_block, list(first.block_ids), first.agent_name) == (0, [10, 11], "p")
    assert book.advance("r", [10, 11], "p") is None  # nothing new this step
    # After a preemption the recomputed prompt may sit in other blocks: only the new tail is told.
    second = book.advance("r", [20, 21, 22, 23], "p")
    assert (second.first_block, list(second.block_ids)) == (2, [22, 23])
    assert book.drop("r") == [10, 11, 22, 23]
    assert book.drop("r") == [] and "r" not in book


def test_a_muted_request_gets_no_more_notices_but_its_lent_blocks_still_come_back():
    book = ProgressBook()
    book.follow("r", "decode-0")
    book.advance("r", [1], "p")
    book.mute("r")
    assert book.requests() == [] and book.advance("r", [1, 2], "p") is None
    assert book.drop("r") == [1]


def test_following_needs_a_consumer_and_a_new_request_id():
    book = ProgressBook()
    with pytest.raises(ValueError, match="^progress_to:"):
        book.follow("r", "")
    book.follow("r", "d")
    with pytest.raises(ValueError, match="^request_id:"):
        book.follow("r", "d")


def _prefetch(pull: list[int], deadline_s: float = 30.0) -> Prefetch:
    plan = ImportPlan(block_ids=[100 + i for i in range(6)], pull_indices=pull, num_reused_tokens=0)
    return Prefetch("r", plan, time.monotonic() + deadline_s)


def _progress(first: int, ids: list[int], agent: str = "p0") -> kv_pb2.KvProgress:
    return kv_pb2.KvProgress(request_id="r", agent_name=agent, first_block=first, block_ids=ids)


def test_a_prefetch_reads_only_announced_blocks_its_own_cache_lacks():
    p = _prefetch(pull=[2, 3, 4, 5])  # blocks 0 and 1 were in this worker's prefix cache
    assert p.announce(_progress(0, [50, 51, 52]))
    batch = p.next_batch(time.monotonic())
    assert batch == [2] and p.remote_ids(batch) == [52]
    p.done(batch, [52])
    assert p.announce(_progress(3, [53, 54]))
    assert p.next_batch(time.monotonic()) == [3, 4]
    assert not p.announce(_progress(5, [55], agent="p1"))  # another producer (a retried prefill): ignored
    assert p.source == "p0"


def test_blocks_read_from_blocks_the_handle_no_longer_names_are_read_again():
    p = _prefetch(pull=[0, 1, 2])
    p.announce(_progress(0, [50, 51]))
    p.done([0, 1], [50, 51])
    assert p.still_pulled([50, 61, 62]) == {0: 50}  # block 1 was recomputed elsewhere (preempted)


def test_a_waiting_prefetch_stops_when_claimed_cancelled_or_expired():
    for stop in ("claim", "cancel"):
        p = _prefetch(pull=[0])
        got: list = []
        t = threading.Thread(target=lambda p=p, got=got: got.append(p.next_batch(time.monotonic())))
        t.start()
        time.sleep(0.05)
        getattr(p, stop)()
        t.join(5)
        assert got == [None], stop
    p = _prefetch(pull=[0], deadline_s=0.05)
    assert p.next_batch(time.monotonic()) is None and p.expired(time.monotonic())
    p = _prefetch(pull=[0])
    p.fail()
    assert p.next_batch(time.monotonic()) is None
