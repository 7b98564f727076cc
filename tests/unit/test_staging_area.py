"""The staging area's copies on streams of its own: a READ that used them returns only once its
last copies have run (`settle` waits for them); on the device's current stream it need not, as
the engine's steps queue behind them there. Off a GPU the stream switch is no switch at all."""

from __future__ import annotations

import torch

from pdserve.kv_transfer.staging import StagingArea


class _Event:
    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def test_settle_waits_for_the_last_copies_only_with_streams_of_its_own() -> None:
    own, shared = StagingArea(torch.device("cpu")), StagingArea(torch.device("cpu"), own_streams=False)
    for area in (own, shared):
        area.copies = [_Event(), _Event()]
        area.settle()
    assert own.own_streams and not shared.own_streams  # streams of its own unless asked otherwise
    assert [e.waited for e in own.copies] == [1, 1]
    assert [e.waited for e in shared.copies] == [0, 0]


def test_copying_off_a_gpu_leaves_the_current_stream_alone() -> None:
    area = StagingArea(torch.device("cpu"))
    with area.copying([torch.zeros(4)]):
        pass
    assert area._streams == {}
