"""`--poll-interval-ms`: the relay polls a decode worker at most once per interval, so each
poll carries the engine steps of the interval; every token still arrives, in order. Off (0),
the next poll goes out as soon as the last is answered."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pdserve.router.router_config import RouterConfig
from pdserve.router.token_relay import TokenRelay
from pdserve.router.token_stream import Stream
from pdserve_proto import worker_pb2


class EveryStep:
    """A decode worker stepping every 2 ms, one token a step for request "r"; a poll answers at
    once with the steps since the acked one, or waits for the next."""

    def __init__(self) -> None:
        self.worker_id = "d0"
        self.polls: list[float] = []
        self.step = 0

    async def poll(self, wait_s: float, timeout_s: float, acked: int | None = None) -> worker_pb2.TokenUpdates:
        loop = asyncio.get_running_loop()
        self.polls.append(loop.time())
        if self.step == 0:
            self.t0 = loop.time()
        steps = int((loop.time() - self.t0) / 0.002)
        if steps <= (acked or 0):
            await asyncio.sleep(0.002)
            steps = (acked or 0) + 1
        self.step = max(self.step, steps)
        return worker_pb2.TokenUpdates(updates=[
            worker_pb2.TokenUpdate(request_id="r", token_ids=[s], seq=s) for s in range((acked or 0) + 1, steps + 1)
        ])


def _relay(interval_s: float, run_s: float) -> tuple[list[float], list[int]]:
    async def go() -> tuple[list[float], list[int]]:
        cfg = RouterConfig(model_id="m", max_model_len=64, vocab_size=100, poll_interval_s=interval_s)
        relay = TokenRelay(cfg, lambda worker, why: None)
        relay.streams["r"] = stream = Stream("d0")
        decode = EveryStep()
        relay.follow(decode)
        await asyncio.sleep(run_s)
        await relay.stop()
        tokens = []
        while not stream.queue.empty():
            tokens += stream.queue.get_nowait()[0]
        return decode.polls, tokens

    return asyncio.run(go())


def test_a_floor_spaces_the_polls_and_loses_no_token():
    polls, tokens = _relay(0.03, 0.2)
    gaps = [b - a for a, b in itertools.pairwise(polls)]
    assert 3 <= len(polls) <= 8 and min(gaps) >= 0.029
    assert tokens == list(range(1, len(tokens) + 1)) and len(tokens) >= 60  # every step, in order, none twice


def test_without_a_floor_every_step_is_a_poll():
    polls, tokens = _relay(0.0, 0.2)
    assert len(polls) >= 30
    assert tokens == list(range(1, len(tokens) + 1))


def test_the_flag_reaches_the_router_config():
    from pdserve.cli import _build_parser
    from pdserve.cluster.join import router_config
    from pdserve.cluster.main import config_from_args, router_config_from_args
    from pdserve.cluster.serve_config import ServeConfig

    assert config_from_args(_build_parser().parse_args(["serve", "--poll-interval-ms", "5"])).poll_interval_s == 0.005
    assert config_from_args(_build_parser().parse_args(["serve"])).poll_interval_s == 0.0
    assert router_config_from_args(_build_parser().parse_args(["router", "--address", "auto", "--poll-interval-ms", "2.5"])).poll_interval_s == 0.0025
    info = worker_pb2.ServeInfo(model_dir="/m/x", max_model_len=64, vocab_size=100, block_size=16, placement_policy="index",
                                  load_factor=1.25)
    assert router_config(info, 0, 0.005).poll_interval_s == 0.005
    for bad in (-0.001, 1.0):
        with pytest.raises(ValueError, match="poll_interval_s"):
            ServeConfig(poll_interval_s=bad)
