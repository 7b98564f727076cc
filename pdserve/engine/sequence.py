"""A request's state inside the engine: its tokens, its KV blocks, how much is computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from pdserve.engine.hashing import ROOT_HASH, hash_block
from pdserve.engine.sampling_params import SamplingParams


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
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    _hashes: list[int] = field(default_factory=list)
    _num_registered: int = 0  # blocks whose hash is registered in the prefix cache

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

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
