"""The descriptors of a READ between sharded pools, and the copy out of the staging area when
the two workers split the KV heads differently (docs/kv-transfer.md, "Tensor-parallel workers").

Equal splits: each run of blocks is one descriptor per shard, rank r's blocks into rank r's.
Different splits: a KV head's bytes within a block are one `head_dim` row per layer, K/V and
token, so reading a head range in place would take that many descriptors per block. Instead
the whole blocks of the producer shards that hold the heads are READ into a staging area
(registered once, reused), and each local slot is then copied from there: every byte crosses
the link once and is copied once more, locally; the next READ into the area waits for those
copies, queued on the GPU (`queued_copies`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from pdserve.kv_transfer.descriptors import coalesce
from pdserve.kv_transfer.shards import ShardSpec, SlotRun

# Blocks READ into the staging area at a time: its size is this many blocks of the producer's
# shards that a READ takes from; a longer block list goes in turns.
STAGING_BLOCKS = 64

Desc = tuple[int, int, int]  # address, bytes, device id


def direct_descriptors(
    runs: Sequence[tuple[int, int, int]],
    local: Sequence[ShardSpec],
    remote: Sequence[ShardSpec],
    bases: tuple[int, int],
    devices: tuple[int, int],
) -> tuple[list[Desc], list[Desc]]:
    """Local and remote descriptors of `runs` (remote start, local start, blocks) between two
    pools of the same split: shard r to shard r. `bases` and `devices`: (local, remote), the
device of the shards that name none."""
    loc_out: list[Desc] = []
    rem_out: list[Desc] = []
    for ls, rs in zip(local, remote):
        loc_dev, rem_dev = _device(ls, devices[0]), _device(rs, devices[1])
        for r, loc, n in runs:
            loc_out.append((bases[0] + ls.offset + loc * ls.block_bytes, n * ls.block_bytes, loc_dev))
            rem_out.append((bases[1] + rs.offset + r * rs.block_bytes, n * rs.block_bytes, rem_dev))
    return loc_out, rem_out


def _device(spec: ShardSpec, default: int) -> int:
    """The device id of a shard's descriptors: its own GPU, else its worker's region's."""
    return default if spec.device is None else spec.device


def staged_descriptors(
    remote_ids: Sequence[int],
    remote: Sequence[ShardSpec],
    used: Sequence[int],
    bases: tuple[int, int],
    devices: tuple[int, int],
) -> tuple[list[Desc], list[Desc], dict[int, int]]:
    """Descriptors that READ blocks `remote_ids` of producer shards `used` into a staging area
    at `bases[0]`: shard p's blocks one after the other from the area's offset `areas[p]`."""
    loc_out: list[Desc] = []
    rem_out: list[Desc] = []
    areas: dict[int, int] = {}
    at = 0
    for p in used:
        spec, areas[p] = remote[p], at
        for r, k, n in coalesce(remote_ids, range(len(remote_ids))):
            loc_out.append((bases[0] + at + k * spec.block_bytes, n * spec.block_bytes, devices[0]))
            rem_out.append((bases[1] + spec.offset + r * spec.block_bytes, n * spec.block_bytes, _device(spec, devices[1])))
        at += len(remote_ids) * spec.block_bytes
    return loc_out, rem_out, areas


def copy_out(
    staging: torch.Tensor,
    areas: dict[int, int],
    remote: Sequence[ShardSpec],
    runs: Sequence[SlotRun],
    pools: Sequence[torch.Tensor],
    local_ids: Sequence[int],
) -> None:
    """Copy each run of slots from the staged producer blocks into local blocks `local_ids` of
    the local shards `pools` ([blocks, layers, 2, tokens, slots, head_dim])."""
    n = len(local_ids)
    layers, kv, tokens, _, head_dim = pools[0].shape[1:]
    dtype = pools[0].dtype
    staged = {}
    for p, at in areas.items():
        nbytes = n * remote[p].block_bytes
        shape = (n, layers, kv, tokens, len(remote[p].kv_heads), head_dim)
        staged[p] = staging[at : at + nbytes].view(dtype).view(shape)
    blocks = coalesce(local_ids, range(n))  # (first local block, first staged block, count)
    for run in runs:
        src = staged[run.src][:, :, :, :, run.src_slot : run.src_slot + run.count]
        dst = pools[run.dst][:, :, :, :, run.dst_slot : run.dst_slot + run.count]
        for first, k, count in blocks:  # one strided copy per run of consecutive local blocks
            dst[first : first + count].copy_(src[k : k + count])


def queued_copies(staging: torch.Tensor, pools: Sequence[torch.Tensor]) -> list[torch.cuda.Event]:
    """An event after the copies just queued out of `staging` on each GPU they involve (the
    current stream of the area's device and of every pool's): none on CPU, where they are done."""
    events = []
    for device in {t.device for t in (staging, *pools) if t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def wait_for(events: list[torch.cuda.Event]) -> None:
    """Block until every event of `queued_copies` has passed."""
    for event in events:
        event.synchronize()


class StagingArea:
    """A worker's staging area: grown and registered on demand (`area`), used by one staged READ
    at a time (`take`/`give_back`), and the copies out of it still queued on the GPU (`copies`:
    a READ into it, a checksum of where they land and the area's release wait for them).

    `own_streams` (the default): the copies out run on streams of the area's own (`copying`), not
    behind the engine's steps on the device's current stream, so a turn waits for its copies
    alone; the READ then waits for its last copies before it returns, as a direct READ returns
    with its bytes in place. Behind a busy decode loop's steps, the current stream made each
    turn wait for them (kv-transfer.md). A transfer writes only blocks the engine's in-flight
    steps are done with (`ImportPlan.wait_writable`), so the copies need no order with those
    steps."""

    def __init__(self, device: torch.device, own_streams: bool = True) -> None:
        self.device = device
        self.own_streams = own_streams
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._turn = threading.Lock()
        self._area: tuple[torch.Tensor, object] | None = None  # the tensor and its registration
        self.copies: list[torch.cuda.Event] = []

    @contextlib.contextmanager
    def copying(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """With `own_streams`, each GPU among `tensors` runs this thread's work on the area's
        stream there (a copy between two GPUs orders itself with both current streams)."""
        with contextlib.ExitStack() as stack:
            for device in {t.device for t in tensors if t.is_cuda} if self.own_streams else ():
                if device not in self._streams:
                    self._streams[device] = torch.cuda.Stream(device=device)
                stack.enter_context(torch.cuda.stream(self._streams[device]))
            yield

    def copy_into(
        self, area: torch.Tensor, areas: dict[int, int], remote: Sequence[ShardSpec], runs: Sequence[SlotRun],
        pools: Sequence[torch.Tensor], local_ids: Sequence[int],
    ) -> None:
        """`copy_out` of what a turn READ into `area` (on the area's own streams where it has
        them); those copies are then the ones the next READ into the area waits for."""
        with self.copying((area, *pools)):
            copy_out(area, areas, remote, runs, pools, local_ids)
            self.copies = queued_copies(area, pools)

    def settle(self) -> None:
        """Before a READ returns: with streams of its own, its last copies have run (the engine's
        steps are not ordered after them); on the current stream, they are ordered already."""
        if self.own_streams:
            wait_for(self.copies)

    def take(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for this READ's turn at the area."""
        return self._turn.acquire(timeout=timeout_s)

    def give_back(self) -> None:
        self._turn.release()

    def area(self, nbytes: int, register: Callable[[torch.Tensor], object], deregister: Callable[[object], None]) -> torch.Tensor:
        """The area, grown to `nbytes` if smaller (during a turn): the old one is deregistered
        once its copies out have run, the new one registered."""
        if self._area is not None and self._area[0].numel() >= nbytes:
            return self._area[0]
        new = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.release(deregister)
        self._area = (new, register(new))
        return new

    def release(self, deregister: Callable[[object], None]) -> None:
        """Deregister the area (after its queued copies out) and drop it."""
        if self._area is not None:
            wait_for(self.copies)
            deregister(self._area[1])
            self._area = None
