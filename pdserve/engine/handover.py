"""KV hand-over between a prefill and a decode engine: the hooks' records and their logic.

Prefill side: a finished request's KV stays pinned (`pinned_kv` says where) until its transfer
is done and `release` frees it. Decode side: `begin_import` allocates blocks for a prompt whose
KV was computed elsewhere (reusing this engine's prefix cache where it can), the transfer fills
them, `commit_import` starts decoding. `LLMEngine` exposes these as methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.hashing import block_hashes
from pdserve.engine.prompt_logprobs import PromptLogprob, prompt_logprobs_of
from pdserve.engine.scheduler import Scheduler, admissible_prefix
from pdserve.engine.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PinnedKv:
    block_ids: list[int]
    block_hashes: list[int]  # of the prompt's full blocks
    num_tokens: int  # prompt tokens whose KV the blocks hold
    first_token: int
    num_cached_tokens: int
    finish_reason: str | None
    first_logprob: float | None = None  # where the request asked for logprobs
    first_top_logprobs: list[tuple[int, float]] | None = None  # where it asked for top_logprobs
    prompt_logprobs: list[PromptLogprob | None] | None = None  # where it asked for prompt_logprobs


@dataclass(frozen=True)
class ImportPlan:
    block_ids: list[int]  # the request's blocks in this engine, in prompt order
    pull_indices: list[int]  # which of them must be filled from the producer
    num_reused_tokens: int  # prompt tokens found in this engine's own prefix cache
    # Set once the device has run every step launched before the blocks were taken: a step still
    # in flight may write a block a request just freed, and a transfer is not ordered with the
    # device's stream. None: nothing was in flight (or no device).
    device_ready: torch.cuda.Event | None = None

    def wait_writable(self) -> None:
        """Block until a transfer may write the plan's blocks. Called outside the engine's lock,
        so the engine keeps stepping (and launching ahead) while this waits."""
        if self.device_ready is not None:
            self.device_ready.synchronize()


def pinned_kv(scheduler: Scheduler, request_id: str, block_size: int) -> PinnedKv:
    """Prefill role: where a finished request's KV sits, for building a transfer handle."""
    seq = scheduler.pinned.get(request_id)
    if seq is None:
        raise KeyError(f"request {request_id!r} has no pinned KV")
    return PinnedKv(
        block_ids=list(seq.block_ids),
        block_hashes=seq.full_block_hashes(block_size)[: seq.num_prompt_tokens // block_size],
        num_tokens=seq.num_prompt_tokens,
        first_token=seq.token_ids[seq.num_prompt_tokens],
        num_cached_tokens=seq.num_cached_tokens,
        finish_reason=seq.finish_reason,
        first_logprob=seq.logprobs[0] if seq.logprobs else None,
        first_top_logprobs=seq.top_logprobs[0] if seq.top_logprobs else None,
        prompt_logprobs=prompt_logprobs_of(seq),
    )


def final_prompt_blocks(scheduler: Scheduler, request_id: str, block_size: int) -> list[int] | None:
    """Prefill role: the prompt's blocks whose KV is final (every layer written), in prompt
    order: all of them once the request is pinned, else its full prompt blocks computed so far
    (chunked prefill finishes a chunk's blocks in one step). None when the engine does not hold
    the request. On a device the last step's writes may still be running (`wait_device`)."""
    seq = scheduler.find(request_id)
    if seq is None:
        return None
    n_prompt_blocks = -(-seq.num_prompt_tokens // block_size)
    if seq.status is SeqStatus.PINNED:
        return list(seq.block_ids[:n_prompt_blocks])
    if seq.status is not SeqStatus.RUNNING:
        return []  # waiting: admitted not yet, or preempted (its blocks were released)
    return list(seq.block_ids[: min(seq.num_computed_tokens, seq.num_prompt_tokens) // block_size])


def check_block_hashes(seq: Sequence, hashes: list[int], block_size: int) -> None:
    """Raise ValueError unless the producer's hashes are exactly the prompt's full blocks'."""
    own = seq.full_block_hashes(block_size)
    if list(hashes) != own[: len(hashes)] or len(hashes) != len(own):
        raise ValueError("block_hashes: do not match the prompt (different block size or hash function?)")


def begin_import(scheduler: Scheduler, seq: Sequence) -> ImportPlan:
    """Decode role: allocate the blocks of an imported prompt (raises NoFreeBlocksError when
    full); blocks already in the prefix cache are reused, the plan lists the rest."""
    pull = scheduler.begin_import(seq)
    return ImportPlan(block_ids=list(seq.block_ids), pull_indices=pull, num_reused_tokens=seq.num_cached_tokens)


def cached_prompt_tokens(blocks: BlockManager, prompt_token_ids: list[int], block_size: int) -> int:
    """Prompt tokens that admission would serve from this engine's prefix cache now."""
    hashes = admissible_prefix(block_hashes(prompt_token_ids, block_size), len(prompt_token_ids), block_size)
    return len(blocks.match_prefix(hashes)) * block_size
