"""A request in flight (`router.inflight.InFlight`): its phases move only forward along the
serving paths, and `close` gives back everything it holds exactly once, whatever the phase."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.admission import PoolQueue
from pdserve.router.background import Background
from pdserve.router.inflight import Books, IllegalPhase, InFlight, Phase
from pdserve.router.router import RouterConfig
from pdserve.router.token_stream import Stream
from pdserve.router.worker_pools import WorkerPools
from tests.unit.router_doubles import FakeDecode, FakePrefill

IDS = list(range(40))


class CountingPrefill(FakePrefill):
    def __init__(self, worker_id: str = "prefill-0") -> None:
        super().__init__(worker_id)
        self.released: list[str] = []

    async def release(self, rid, timeout_s) -> None:
        self.released.append(rid)


class World:
    """`n` decode workers and one prefill worker, and the books a router keeps over them."""

    def __init__(self, n: int = 2) -> None:
        self.decodes = [FakeDecode(f"decode-{i}") for i in range(n)]
        self.prefill = CountingPrefill()
        cfg = RouterConfig(model_id="m", max_model_len=4096, vocab_size=100)
        self.pools = WorkerPools(cfg, [self.prefill], self.decodes)
        self.queues = {pool: PoolQueue(pool, 0) for pool in ("prefill", "decode")}
        self.streams: dict[str, Stream] = {}
        self.background = Background()
        self.books = Books(self.pools, self.queues, self.streams, self.background, 1.0)

    def request(self, rid: str = "r1", remote: bool = True) -> InFlight:
        d_at = self.pools.decode_policy.place([], len(IDS))
        assert d_at is not None
        r = InFlight(self.books, rid, IDS, SamplingParams(max_tokens=4), None, IncrementalDetokenizer(None), d_at)
        if remote:
            p_at = self.pools.prefill_policy.place([], len(IDS), 0.0)
            assert p_at is not None
            r.place_prefill(p_at)
        return r

    def counts(self) -> dict[str, object]:
        """Everything the books count, by name."""
        pools = self.pools
        return {
            "busy": {w: pools.busy(w) for w in ("prefill-0", *pools.decodes)},
            "decode slots": dict(pools.decode_policy.inflight),
            "prefill slots": dict(pools.prefill_policy.inflight),
            "queued": {p: q.queued for p, q in self.queues.items()},
            "streams": sorted(self.streams),
        }


IDLE = {
    "busy": {"prefill-0": 0, "decode-0": 0, "decode-1": 0},
    "decode slots": {"decode-0": 0, "decode-1": 0},
    "prefill slots": {"prefill-0": 0},
    "queued": {"prefill": 0, "decode": 0},
    "streams": [],
}
IDLE_ONE = {**IDLE, "busy": {"prefill-0": 0, "decode-0": 0}, "decode slots": {"decode-0": 0}}


def test_the_remote_and_local_paths_are_legal_and_nothing_else_is():
    w = World()
    remote = w.request("a")
    for phase in (Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING, Phase.DONE):
        remote.enter(phase)
    local = w.request("b", remote=False)
    for phase in (Phase.HANDING_OVER, Phase.DECODING, Phase.DONE):
        local.enter(phase)
    early = w.request("c")
    early.enter(Phase.PREFILLING)
    early.finished()  # ended at its first token
    assert early.phase is Phase.DONE

    illegal = [
        (Phase.QUEUED, Phase.DECODING),  # decoding without a hand-over
        (Phase.PREFILLING, Phase.DECODING),
        (Phase.HANDING_OVER, Phase.PREFILLING),  # backwards
        (Phase.DECODING, Phase.HANDING_OVER),
        (Phase.DECODING, Phase.DECODING),
        (Phase.QUEUED, Phase.QUEUED),
    ]
    path = [Phase.QUEUED, Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING]
    for i, (at, to) in enumerate(illegal):
        r = w.request(f"x{i}")
        for phase in path[1 : path.index(at) + 1]:
            r.enter(phase)
        with pytest.raises(IllegalPhase, match=f"{at.value} -> {to.value}"):
            r.enter(to)
        assert r.phase is at  # a refused move changes nothing


def test_nothing_follows_done_or_close():
    async def main() -> None:
        w = World()
        r = w.request()
        r.close()  # queued on a prefill worker: its release goes out in the background
        assert r.phase is Phase.DONE
        for phase in Phase:
            with pytest.raises(IllegalPhase):
                r.enter(phase)
        await w.background.drain()
        assert w.prefill.released == ["r1"]

    asyncio.run(main())


@pytest.mark.parametrize("phase", [Phase.QUEUED, Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING, Phase.DONE])
def test_close_gives_back_everything_once_from_any_phase(phase):
    async def main() -> None:
        w = World(n=1)
        other = w.request("other", remote=False)  # one that stays, on the same workers: its share must not move
        other.open()
        other.enqueue("decode")
        idle_but_other = w.counts()
        r = w.request()
        r.open()
        r.enqueue("prefill")
        for p in (Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING, Phase.DONE)[
            : [Phase.QUEUED, Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING, Phase.DONE].index(phase)
        ]:
            r.enter(p)
        if phase is Phase.HANDING_OVER:
            r.enqueue("decode")
        held = w.counts()
        assert held["streams"] == ["other", "r1"]
        assert held["busy"]["prefill-0"] == (0 if phase in (Phase.DECODING, Phase.DONE) else 1)
        assert held["decode slots"] == {"decode-0": 2} and held["busy"]["decode-0"] == 2
        assert held["prefill slots"] == {"prefill-0": 1}  # no prefill call ended it

        r.close()
        r.close()  # idempotent: a second close gives nothing back twice
        assert w.counts() == idle_but_other
        other.finished()
        other.close()
        assert w.counts() == IDLE_ONE
        await w.background.drain()
        r.close()
        await w.background.drain()

        # On the workers: freed once, and only where the phase says the request may be.
        aborts = [c for d in w.decodes for c in d.calls if c == ("abort", "r1")]
        assert len(aborts) == (1 if phase in (Phase.HANDING_OVER, Phase.DECODING) else 0)
        released = w.prefill.released.count("r1")
        assert released == (1 if phase in (Phase.QUEUED, Phase.PREFILLING, Phase.HANDING_OVER) else 0)

    asyncio.run(main())


def test_decoding_lets_go_of_the_prefill_worker_and_close_does_not_again():
    w = World()
    r = w.request()
    r.open()
    r.prefill_ended(1.0, 0, 0.06)  # the prefill call ended: its slot is back, with what it cost
    r.prefill_ended(2.0, 0, 0.06)
    assert w.pools.prefill_policy.inflight == {"prefill-0": 0}
    # What the worker's steps spent on it is the pool's rate (once: the second end is no call).
    assert w.pools.prefill_policy.drains["prefill-0"].tokens_per_s() == pytest.approx(r.p_at.num_tokens / 0.06)
    for phase in (Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING):
        r.enter(phase)
    assert w.pools.busy("prefill-0") == 0
    assert r.held == (r.d_at.worker,)
    r.finished()
    r.close()
    assert w.counts() == IDLE


def test_a_move_carries_the_hold_and_the_slot_to_the_new_worker():
    w = World()
    r = w.request(remote=False)
    r.open()
    first = r.d_at.worker
    second = "decode-1" if first == "decode-0" else "decode-0"
    r.enter(Phase.HANDING_OVER)
    r.leave_decode_worker()
    assert r.stream.worker is None
    d_at = w.pools.decode_policy.place([], len(IDS))
    assert d_at is not None and d_at.worker == second
    r.move_decode(d_at)
    assert (w.pools.busy(first), w.pools.busy(second)) == (0, 1)
    assert w.pools.decode_policy.inflight == {first: 0, second: 1}
    assert r.stream.worker == second and r.decode is w.decodes[int(second[-1])]
    assert r.failed_on(first, w.pools.decodes) == 1
    r.enter(Phase.DECODING)
    r.finished()
    r.close()
    assert w.counts() == IDLE


def test_a_refused_request_closed_before_it_opened_leaves_a_namesake_alone():
    w = World()
    serving = w.request("same", remote=False)
    serving.open()
    refused = w.request("same", remote=False)
    refused.close()  # placement gave up on it: it never opened, and nothing of it is on a worker
    assert w.streams == {"same": serving.stream}
    assert w.pools.busy(serving.d_at.worker) == 1
    serving.finished()
    serving.close()
    assert w.counts() == IDLE
