"""A request's state inside the engine: its tokens, its KV blocks, how much is computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.hashing import ROOT_HASH, hash_block
from pdserve.engine.penalty_tokens import PenaltyTokens
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's score (`prompt_logprobs`): its logprob, its rank (1: the most likely token), and the
    request's N most likely tokens at its position as (token, logprob), best first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()



class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    IMPORTING = "importing"  # decode role: blocks allocated, KV being pulled from a prefill worker
    PINNED = "pinned"  # prefill role: done, KV blocks held for a transfer until released
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # monotonically increasing admission order; lower is older (higher priority)
    token_ids: list[int] = field(init=False)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With params.prompt_logprobs: the score of prompt token i + 1 at index i, as computed so far.
    prompt_logprobs: list[PromptLogprob] | None = field(init=False, default=None)
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    _token_buf: np.ndarray | None = None  # token_ids as an array, for penalties (see token_array)
    _token_buf_len: int = 0  # how many of token_ids it holds
    # Distinct tokens and output counts for the penalties, kept between steps (rebuilt from
    # token_ids whenever they do not continue it).
    penalty_tokens: PenaltyTokens = field(default_factory=PenaltyTokens, repr=False, compare=False)
    _block_buf: np.ndarray | None = None  # block_ids as an int32 array (see block_array)
    _block_src: list[int] | None = None  # the block_ids list it mirrors
    _block_buf_len: int = 0
    _hashes: list[int] = field(default_factory=list)
    _num_registered: int = 0  # blocks whose hash is registered in the prefix cache

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def token_array(self) -> np.ndarray:
        """`token_ids` as an int64 array, kept in step as tokens are appended (they only ever
        are), so a penalized row costs its new tokens per step, not all of them."""
        n, have = len(self.token_ids), self._token_buf_len
        buf = self._token_buf
        if buf is None or len(buf) < n:  # grown by doubling: appending stays O(1) amortised
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = self._token_buf = grown
        if have < n:
            buf[have:n] = self.token_ids[have:n]
            self._token_buf_len = n
        return buf[:n]

    def block_array(self) -> np.ndarray:
        """`block_ids` as an int32 array, kept in step as blocks are appended, so that a step's
        block tables are filled by array copies instead of converting every list every step. A
        list replaced or shortened (admission with cache hits, preemption, finish) is copied anew."""
        ids, n = self.block_ids, len(self.block_ids)
        buf, have = self._block_buf, self._block_buf_len
        if self._block_src is not ids or n < have:
            buf, have, self._block_src = None, 0, ids
        if buf is None or len(buf) < n:
            grown = np.empty(max(2 * n, 16), dtype=np.int32)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = self._block_buf = grown
        if have < n:
            buf[have:n] = ids[have:n]
        self._block_buf_len = n
        return buf[:n]

    def full_block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of every full block of the current tokens, extended incrementally."""
        n_full = len(self.token_ids) // block_size
        parent = self._hashes[-1] if self._hashes else ROOT_HASH
        for i in range(len(self._hashes), n_full):
            parent = hash_block(parent, self.token_ids[i * block_size : (i + 1) * block_size])
            self._hashes.append(parent)
        return self._hashes[:n_full]

    def reset_for_recompute(self) -> None:
        """After preemption: the KV is gone, every token (prompt + output) is prefilled again."""
        self.block_ids = []
        self.num_computed_tokens = 0
        self._num_registered = 0
        self.status = SeqStatus.WAITING
        self.num_preemptions += 1
