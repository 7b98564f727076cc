"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

Each step gives every running sequence its next tokens first (preempting the newest when blocks
run out), then admits waiting ones while the budget, `max_num_seqs` and the free blocks allow.
Roles: ``both`` runs prompts to completion; ``prefill`` stops after the first token and keeps the
blocks pinned until ``release_pinned``; ``decode`` also takes imported sequences
(``begin_import``, ``commit_import``; an import that finds the batch full waits in ``ready``).
docs/engine.md, "Scheduling"."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager, NoFreeBlocksError
from pdserve.engine.config import Role
from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.engine.step_slack import StepSlack


def admissible_prefix(full_block_hashes: list[int], num_tokens: int, block_size: int) -> list[int]:
    """The block hashes of a prompt that admission may serve from the prefix cache: whole blocks,
    never the one holding the last token (at least one token must be computed for logits)."""
    return full_block_hashes[: (num_tokens - 1) // block_size]


@dataclass(slots=True)
class ScheduledSeq:
    """One row of a step: `num_new_tokens` of `seq` (not frozen: one is built for every row of
    every step, and a frozen dataclass's init costs three times as much)."""

    seq: Sequence
    num_new_tokens: int
    sample: bool  # the chunk reaches the last known token, so its logits give the next token


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    role: Role = "both"
    # Prompt tokens a step may carry beside rows that decode (None: the whole budget). A small
    # cap keeps a decode worker's inter-token time near its decode step while it prefills.
    max_prefill_tokens_with_decodes: int | None = None


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager, eos_token_ids: tuple[int, ...]) -> None:
        self.limits = limits
        self.blocks = blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pinned: dict[str, Sequence] = {}
        self.importing: dict[str, Sequence] = {}
        self.ready: deque[Sequence] = deque()  # imported, waiting for a place in the running batch
        self.num_preemptions = 0
        # Measured step costs (the engine feeds them): prompt tokens beside decodes are held to
        # what keeps a step within its target (`--itl-target-ms`). None: only the static cap.
        self.slack: StepSlack | None = None

    @property
    def caps_prompts(self) -> bool:
        """Whether prompt tokens beside decoding rows are capped at all (if not, nothing is counted)."""
        return self.slack is not None or self.limits.max_prefill_tokens_with_decodes is not None

    def prompt_room(self, decoding: int | None = None) -> int | None:
        """The prompt tokens a step may carry beside its `decoding` decode rows (None: counted
        from the running sequences): the static cap and the measured slack, whichever is lower.
        None where nothing caps them (no cap set, or no row decodes): the step budget."""
        if not self.caps_prompts:
            return None
        if decoding is None:
            decoding = sum(1 for s in self.running if decodes(s))
        if decoding == 0:
            return None
        static = self.limits.max_prefill_tokens_with_decodes
        if self.slack is None:
            return static
        room = self.slack.room(decoding)
        return room if static is None else min(room, static)

    # ----- admission -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    def find(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.ready, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    return seq
        return self.pinned.get(request_id) or self.importing.get(request_id)

    # ----- one step ------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.limits.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted_any = False
        # Imported sequences hold their blocks already: they take free places before new prompts.
        while self.ready and len(self.running) < self.limits.max_num_seqs:
            self.running.append(self.ready.popleft())

        cap = self.prompt_room()
        room = budget if cap is None else cap
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if cap is not None and (n > 1 or not decodes(seq)):  # a prompt chunk: within the room left
                n = min(n, room)
                if n == 0:
                    i += 1
                    continue
                room -= n
            while not self._grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted_any = True
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
                budget -= n
                i += 1
                continue
            # `seq` itself was preempted (it was the newest); everything after it is gone too.
            break

        # Admitting new work right after a preemption would only thrash.
        max_seqs = self.limits.max_num_seqs
        while not preempted_any and self.waiting and min(budget, room) > 0 and len(self.running) < max_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, min(budget, room)):
                break
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, room)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
            room -= n
        return out

    def admit_ahead(self, budget: int, room: int | None = None) -> Iterator[tuple[Sequence, int]]:
        """Admissions into a step planned while another runs (`overlap_plan`), as `schedule`
        makes them but without preempting: imported sequences, then waiting prompts (at most
        `room` prompt tokens of them; None: the budget). Yields each admitted sequence with its
        tokens in that step; stop iterating to admit no more."""
        while self.ready and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.ready[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + n):
                return
            self.running.append(self.ready.popleft())
            yield seq, n
            budget -= n
        room = budget if room is None else min(room, budget)
        while self.waiting and room > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, room):
                return
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, room)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            yield seq, n
            room -= n

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens of a running sequence without preempting anyone
        (a step launched ahead of scheduling); False if the blocks are not there."""
        return self._grow(seq, num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        extra = self.blocks.blocks_needed(num_tokens) - len(seq.block_ids)
        if extra <= 0:
            return True
        if extra > self.blocks.num_available:
            return False
        # Continuing after its last block keeps a chunked prompt in few runs (transfer descriptors).
        seq.block_ids.extend(self.blocks.allocate(extra, after=seq.block_ids[-1] if seq.block_ids else None))
        return True

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Take prefix-cache hits and allocate blocks for the first chunk; False if it can't fit.
        A request whose prompt tokens still need their prompt_logprobs takes no hits: a cached
        token has no logits to score it (vLLM does the same)."""
        bs = self.blocks.block_size
        hits: list[int] = []
        scored = seq.prompt_logprobs is None or len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1
        if seq.num_computed_tokens == 0 and scored:
            hits = self.blocks.match_prefix(admissible_prefix(seq.full_block_hashes(bs), seq.num_tokens, bs))
        computed = max(seq.num_computed_tokens, len(hits) * bs)
        n = min(seq.num_tokens - computed, budget)
        need = self.blocks.blocks_needed(computed + n) - len(seq.block_ids) - len(hits)
        if need > self.blocks.num_available - self.blocks.num_evictable_among(hits):
            return False
        if hits:
            self.blocks.acquire(hits)
            seq.block_ids = hits + seq.block_ids
            seq.num_computed_tokens = computed
            seq._num_registered = len(hits)
        if seq.num_preemptions == 0 and seq.num_output_tokens == 0:
            seq.num_cached_tokens = len(hits) * bs
        if need > 0:
            # Room for the whole prompt, so its later chunks can follow on in consecutive ids.
            room = self.blocks.blocks_needed(seq.num_tokens) - len(seq.block_ids)
            seq.block_ids.extend(self.blocks.allocate(need, after=seq.block_ids[-1] if seq.block_ids else None, room=room))
        return True

    def _preempt(self, seq: Sequence) -> None:
        if self.blocks.blocks_needed(seq.num_tokens + 1) > self.blocks.num_blocks:
            # It could never fit again, even alone: recomputing would loop forever.
            self.finish(seq, "length")
            return
        self.running.remove(seq)
        self.blocks.release(seq.block_ids)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ----- KV import (decode role) ----------------------------------------------------------

    def begin_import(self, seq: Sequence) -> list[int]:
        """Allocate blocks for a sequence whose prompt KV is computed elsewhere. Full blocks found
        in this worker's prefix cache are reused; returns the indices (into ``seq.block_ids``) of
        the blocks whose data must be pulled."""
        bs = self.blocks.block_size
        n = seq.num_prompt_tokens
        hits = self.blocks.match_prefix(seq.full_block_hashes(bs)[: n // bs])
        need = self.blocks.blocks_needed(n) - len(hits)
        if need > self.blocks.num_available - self.blocks.num_evictable_among(hits):
            raise NoFreeBlocksError(f"need {need} KV blocks to import {seq.request_id}, {self.blocks.num_available} available")
        self.blocks.acquire(hits)
        seq.block_ids = hits + self.blocks.allocate(need)
        seq._num_registered = len(hits)
        seq.num_cached_tokens = len(hits) * bs
        seq.status = SeqStatus.IMPORTING
        self.importing[seq.request_id] = seq
        return list(range(len(hits), len(seq.block_ids)))

    def commit_import(self, seq: Sequence, first_token: int) -> None:
        """The pulled KV is in place: the sequence joins the decode batch after its first token."""
        del self.importing[seq.request_id]
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._register_full_blocks(seq, self.blocks.block_size)
        seq.token_ids.append(first_token)
        seq.status = SeqStatus.RUNNING
        if len(self.running) < self.limits.max_num_seqs:
            self.running.append(seq)
        else:
            self.ready.append(seq)
        reason = self._stop_reason(seq, first_token)
        if reason is not None:
            self.finish(seq, reason)

    # ----- after the model ran -------------------------------------------------------------

    def update(self, scheduled: list[ScheduledSeq], sampled: dict[str, int]) -> list[Sequence]:
        """Advance computed counts, register full blocks in the prefix cache, append sampled
        tokens and finish sequences that hit a stop condition. Returns the sequences that
        produced a token this step."""
        produced: list[Sequence] = []
        bs = self.blocks.block_size
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self._register_full_blocks(seq, bs)
            if not item.sample:
                continue
            token = sampled[seq.request_id]
            seq.token_ids.append(token)
            produced.append(seq)
            reason = self._stop_reason(seq, token)
            if self.limits.role == "prefill":
                self._pin(seq, reason)
            elif reason is not None:
                self.finish(seq, reason)
        return produced

    def _register_full_blocks(self, seq: Sequence, bs: int) -> None:
        n_full = seq.num_computed_tokens // bs
        if n_full <= seq._num_registered:
            return
        hashes = seq.full_block_hashes(bs)
        for i in range(seq._num_registered, n_full):
            self.blocks.register(seq.block_ids[i], hashes[i])
        seq._num_registered = n_full

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def _pin(self, seq: Sequence, reason: str | None) -> None:
        self.running.remove(seq)
        seq.status = SeqStatus.PINNED
        seq.finish_reason = reason
        self.pinned[seq.request_id] = seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence wherever it is and free its blocks (stop, length, abort)."""
        if seq.status is SeqStatus.RUNNING:
            # `ready` is almost always empty: look there first, and scan `running` only once.
            if any(s is seq for s in self.ready):
                self.ready.remove(seq)
            else:
                self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.PINNED:
            del self.pinned[seq.request_id]
        elif seq.status is SeqStatus.IMPORTING:
            del self.importing[seq.request_id]
        else:
            return
        self.blocks.release(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def release_pinned(self, request_id: str) -> bool:
        seq = self.pinned.get(request_id)
        if seq is None:
            return False
        self.finish(seq, seq.finish_reason or "transferred")
        return True


def decodes(seq: Sequence) -> bool:
    """Whether the sequence's next row generates (past its prompt, one token to compute)."""
    return seq.num_output_tokens > 0 and seq.num_tokens - seq.num_computed_tokens == 1
