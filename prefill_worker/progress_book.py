"""What a prefill worker has told each decode worker about prompts still being prefilled
(`--kv-transfer-overlap`), and which blocks it lent them (pure: no engine, no transport).

A request followed here has a consumer (the decode worker's agent). Each time more of its
prompt's blocks are final, `advance` returns a `KvProgress` naming the new ones; the worker lends
them (a reference of their own, so a preemption or an abort of the request cannot free them
while the consumer may be reading) and sends the notice. `drop` ends the following and returns
every block lent, for the worker to give back once the request's KV is pulled, released or its
lease has expired.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve_proto import kv_pb2


@dataclass
class _Follower:
    consumer: str  # the decode worker's agent name
    announced: int = 0  # prompt blocks already in a notice
    lent: list[int] = field(default_factory=list)
    muted: bool = False  # a notice failed: no more go out, the consumer reads the rest from the handle


class ProgressBook:
    """Per followed request: its consumer, the blocks announced and lent, whether muted."""

    def __init__(self) -> None:
        self._followers: dict[str, _Follower] = {}

    def follow(self, request_id: str, consumer: str) -> None:
        if not consumer:
            raise ValueError(f"progress_to: empty agent name for {request_id}")
        if request_id in self._followers:
            raise ValueError(f"request_id: {request_id!r} is already followed")
        self._followers[request_id] = _Follower(consumer)

    def requests(self) -> list[str]:
        """The requests whose consumer still gets notices."""
        return [rid for rid, f in self._followers.items() if not f.muted]

    def consumer(self, request_id: str) -> str:
        return self._followers[request_id].consumer

    def advance(self, request_id: str, final_blocks: list[int], agent_name: str) -> kv_pb2.KvProgress | None:
        """The notice for the blocks of `final_blocks` (the prompt's final blocks, in order) not
        announced yet, recorded as lent; None when there are none."""
        f = self._followers.get(request_id)
        if f is None or f.muted or len(final_blocks) <= f.announced:
            return None
        new = final_blocks[f.announced:]
        progress = kv_pb2.KvProgress(
            request_id=request_id, agent_name=agent_name, first_block=f.announced, block_ids=new
        )
        f.announced = len(final_blocks)
        f.lent.extend(new)
        return progress

    def mute(self, request_id: str) -> None:
        f = self._followers.get(request_id)
        if f is not None:
            f.muted = True

    def drop(self, request_id: str) -> list[int]:
        """Stop following a request; the blocks lent for it, to give back (empty if none)."""
        f = self._followers.pop(request_id, None)
        return [] if f is None else f.lent

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._followers

    def __len__(self) -> int:
        return len(self._followers)
