"""The step rank 0 hands to the other ranks of a tensor-parallel worker: the flattened inputs
its runner prepared (token ids, positions, KV slots, block tables, rows to take logits of,
rows whose logits score prompt tokens), as bytes; for a decode step it replays as a CUDA graph,
the graph's padded rows (`GraphRows`), which every rank replays its own copy of. The other
ranks only execute what they get, so every rank runs the same forward in the same order and
meets the same collectives (`capture_message`: record the graphs, in rank 0's order).

The steps go over a pipe from rank 0 to each other rank: an idle rank waits as long as rank 0
is idle, and one whose rank 0 is gone reads the pipe's end and stops."""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from pdserve.engine.cuda_graphs import GraphRows
from pdserve.engine.kernels.attention import AttentionMetadata

_HEADER = 8  # kind, tokens, sequences, block-table width, logits rows, max query len, max seq len, scored rows
_STEP, _STOP, _GRAPH, _CAPTURE = 1, 0, 2, 3


@dataclass(frozen=True)
class RankStep:
    """One forward pass as a non-zero rank runs it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Rows whose logits score prompt tokens (`prompt_logprobs`), in rank 0's order: the LM head's
    # gathers over them come before the sampled rows' (`prompt_logprobs.SLICE_ROWS` at a time).
    score_rows: torch.Tensor


def encode_step(
    token_rows: torch.Tensor, logits_indices: torch.Tensor, meta: AttentionMetadata, score_rows: list[int] | None = None
) -> bytes:
    """A step's bytes: `token_rows` [4, T] (ids, positions, slot block, slot offset), the logits
    rows, the attention metadata's device tensors and the rows that score prompt tokens."""
    b, width = meta.block_tables.shape
    scored = np.asarray(score_rows or [], dtype=np.int64)
    header = np.array(
        [_STEP, token_rows.shape[1], b, width, logits_indices.numel(), meta.max_query_len, meta.max_seq_len, len(scored)],
        dtype=np.int64,
    )
    longs = torch.cat([token_rows.reshape(-1), logits_indices]).cpu().numpy()
    ints = torch.cat([meta.cu_seqlens_q, meta.seq_lens, meta.block_tables.reshape(-1)]).cpu().numpy()
    return header.tobytes() + longs.astype(np.int64).tobytes() + ints.astype(np.int32).tobytes() + scored.tobytes()


@dataclass(frozen=True)
class CaptureGraphs:
    """Record the decode graphs now (`capture_message`)."""


def encode_graph_step(rows: GraphRows) -> bytes:
    """A decode step rank 0 replays as a graph: the graph's padded rows."""
    b, cols = rows.table.shape
    header = np.array([_GRAPH, b, cols] + [0] * (_HEADER - 3), dtype=np.int64)
    return (
        header.tobytes()
        + rows.longs.astype(np.int64, copy=False).tobytes()
        + rows.seq_lens.astype(np.int32, copy=False).tobytes()
        + rows.table.astype(np.int32, copy=False).tobytes()
    )


def capture_message() -> bytes:
    return np.array([_CAPTURE] + [0] * (_HEADER - 1), dtype=np.int64).tobytes()


def _graph_rows(payload: bytes, b: int, cols: int) -> GraphRows:
    at = _HEADER * 8
    longs = np.frombuffer(payload, dtype=np.int64, count=4 * b, offset=at).reshape(4, b)
    at += 4 * b * 8
    seq_lens = np.frombuffer(payload, dtype=np.int32, count=b, offset=at)
    table = np.frombuffer(payload, dtype=np.int32, count=b * cols, offset=at + b * 4).reshape(b, cols)
    return GraphRows(longs, seq_lens, table)


def decode_step(payload: bytes, device: torch.device | None = None) -> RankStep | GraphRows | CaptureGraphs | None:
    """`encode_step`'s step back, its tensors on `device` (None: the host); the graph step's
    rows (`encode_graph_step`); `CaptureGraphs`; None for the stop message."""
    header = np.frombuffer(payload, dtype=np.int64, count=_HEADER)
    kind, t, b, width, n_logits, max_q, max_seq, n_scored = (int(v) for v in header)
    if kind == _STOP:
        return None
    if kind == _GRAPH:
        return _graph_rows(payload, t, b)
    if kind == _CAPTURE:
        return CaptureGraphs()
    at = _HEADER * 8
    longs = torch.from_numpy(np.frombuffer(payload, dtype=np.int64, count=4 * t + n_logits, offset=at).copy())
    at += longs.numel() * 8
    ints = torch.from_numpy(np.frombuffer(payload, dtype=np.int32, count=2 * b + 1 + b * width, offset=at).copy())
    at += ints.numel() * 4
    scored = torch.from_numpy(np.frombuffer(payload, dtype=np.int64, count=n_scored, offset=at).copy())
    cu, seq_lens = ints[: b + 1], ints[b + 1 : 2 * b + 1]
    seq_lens_host = seq_lens.tolist()
    query_lens = (cu[1:] - cu[:-1]).tolist()
    if device is not None and device.type != "cpu":
        # Two copies a step, the lists above read on the host first.
        longs, ints, scored = longs.to(device), ints.to(device), scored.to(device)
        cu, seq_lens = ints[: b + 1], ints[b + 1 : 2 * b + 1]
    meta = AttentionMetadata(
        slot_block=longs[2 * t : 3 * t],
        slot_offset=longs[3 * t : 4 * t],
        cu_seqlens_q=cu,
        seq_lens=seq_lens,
        block_tables=ints[2 * b + 1 :].view(b, width),
        max_query_len=max_q,
        max_seq_len=max_seq,
        query_lens=query_lens,
        seq_lens_host=seq_lens_host,
    )
    return RankStep(longs[:t], longs[t : 2 * t], meta, longs[4 * t :], scored)


def stop_message() -> bytes:
    return np.array([_STOP] + [0] * (_HEADER - 1), dtype=np.int64).tobytes()


class StepSender:
    """Rank 0's end: each step to every other rank's pipe."""

    def __init__(self, pipes: list[Connection]) -> None:
        self.pipes = pipes

    def send(self, payload: bytes) -> None:
        for pipe in self.pipes:
            pipe.send_bytes(payload)


def receive_step(pipe: Connection, device: torch.device | None = None) -> RankStep | GraphRows | CaptureGraphs | None:
    """A non-zero rank's next step, on `device`; None once rank 0 stops, or is gone (its end closed)."""
    try:
        return decode_step(pipe.recv_bytes(), device)
    except (EOFError, OSError):
        return None
