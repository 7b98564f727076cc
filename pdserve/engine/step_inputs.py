"""A step's inputs on the device: the scheduled rows flattened into token ids, positions, KV
slots, attention metadata and the rows whose logits are sampled, in two host-to-device copies
(one int64 buffer, one int32 buffer) instead of one per tensor: decode steps are short enough
that each copy's fixed cost shows."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pdserve.engine.kernels.attention import AttentionMetadata
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence


@dataclass
class StepInputs:
    """A step flattened for the forward pass (see the module's docstring)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[ScheduledSeq]
    token_rows: torch.Tensor  # [4, T]: input_ids, positions, slot_block, slot_offset (one buffer)


def build_step_inputs(
    scheduled: list[ScheduledSeq],
    ahead: int | list[int],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """The inputs of `scheduled`. `ahead` (one for every row, or per row): rows start that many
    positions past their computed tokens, behind a step still in flight; an input token not known
    on the host yet (that step's draw, still on the device) is left as 0."""
    bs = block_size
    b = len(scheduled)
    seqs = [item.seq for item in scheduled]
    query_lens = [item.num_new_tokens for item in scheduled]
    offsets = [ahead] * b if isinstance(ahead, int) else ahead
    starts = [seq.num_computed_tokens + m for seq, m in zip(seqs, offsets)]
    seq_lens_host = [s + n for s, n in zip(starts, query_lens)]
    t = sum(query_lens)
    sample = np.fromiter((item.sample for item in scheduled), dtype=bool, count=b)
    sampled = [item for item in scheduled if item.sample]
    num_sampled = len(sampled)
    blocks = [seq.block_array() for seq in seqs]
    width = max(len(row) for row in blocks)
    # Whole-array operations, not per-token or per-row Python: a 2,048-token chunk or a few
    # hundred decode rows would otherwise cost milliseconds of the step.
    longs = np.empty(4 * t + num_sampled, dtype=np.int64)  # ids, positions, slot block, offset, logits rows
    ints = np.zeros(2 * b + 1 + b * width, dtype=np.int32)  # cu_seqlens_q, seq_lens, block tables
    ids, pos, slot_block, slot_offset = (longs[k * t : (k + 1) * t] for k in range(4))
    cu, seq_lens, tables = ints[: b + 1], ints[b + 1 : 2 * b + 1], ints[2 * b + 1 :].reshape(b, width)
    for i, row in enumerate(blocks):
        tables[i, : len(row)] = row
    np.cumsum(query_lens, out=cu[1:])
    seq_lens[:] = seq_lens_host
    if t == b:  # one token a row: a decode step
        pos[:] = starts
        row_of = np.arange(b)
        ids[:] = [known_token(seq, s) for seq, s in zip(seqs, starts)]
    else:
        row_of = np.repeat(np.arange(b), query_lens)
        first = cu[:-1].astype(np.int64)
        pos[:] = np.arange(t) + np.repeat(np.asarray(starts, dtype=np.int64) - first, query_lens)
        ids[:] = np.fromiter(
            chain.from_iterable(known_tokens(seq, s, n) for seq, s, n in zip(seqs, starts, query_lens)),
            dtype=np.int64, count=t,
        )  # fmt: skip
    slot_block[:] = tables[row_of, pos // bs]
    np.remainder(pos, bs, out=slot_offset)
    longs[4 * t :] = cu[1:][sample] - 1
    longs_dev = to_device(longs, device)
    ints_dev = to_device(ints, device)
    meta = AttentionMetadata(
        slot_block=longs_dev[2 * t : 3 * t],
        slot_offset=longs_dev[3 * t : 4 * t],
        cu_seqlens_q=ints_dev[: b + 1],
        seq_lens=ints_dev[b + 1 : 2 * b + 1],
        block_tables=ints_dev[2 * b + 1 :].view(b, width),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_host),
        query_lens=query_lens,
        seq_lens_host=seq_lens_host,
    )
    return StepInputs(
        input_ids=longs_dev[:t],
        positions=longs_dev[t : 2 * t],
        meta=meta,
        logits_indices=longs_dev[4 * t :],
        sampled=sampled,
        token_rows=longs_dev[: 4 * t].view(4, t),
    )


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` on `device` without the host waiting for the device: from pinned memory, since a
    copy from pageable memory first waits for everything queued, a step launched ahead included."""
    host = torch.from_numpy(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def known_token(seq: Sequence, position: int) -> int:
    """The input token at `position`, or 0 where it is not on the host yet (a draw in flight)."""
    return seq.token_ids[position] if position < len(seq.token_ids) else 0


def known_tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """`known_token` for positions start .. start + n - 1."""
    have = seq.token_ids[start : start + n]
    return have if len(have) == n else have + [0] * (n - len(have))
