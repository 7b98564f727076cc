"""The requests an engine holds: each checked on the way in (`validate`, `tokenize`), named,
and kept with its `Sequence` and incremental detokenizer until the engine forgets it. What runs
when is the scheduler's job, not this table's."""

from __future__ import annotations

import itertools
from typing import Any

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


class RequestTable:
    """Every request an engine holds, by id: its sequence and its detokenizer. It refuses a
    request that could never be served, naming the field, before the engine takes it."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, max_model_len: int, blocks: BlockManager) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.blocks = blocks
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt token ids instead")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return list(self.tokenizer.encode(prompt))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        vocab = self.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids: token {t!r} at index {i} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate in the model's context of {self.max_model_len} tokens"
            )
        if self.blocks.blocks_needed(n + 1) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt: {n} tokens need more KV blocks than the whole pool holds ({self.blocks.num_blocks})"
            )
        if not isinstance(params, SamplingParams):
            # ValueError like every other refusal here: callers answer it as the request's fault.
            raise ValueError("sampling_params: expected a SamplingParams")  # noqa: TRY004
        bad_bias = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias: token {bad_bias} is outside the vocabulary [0, {vocab})")

    def new_sequence(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None) -> Sequence:
        """A validated request as a sequence, named `req-N` when no id is given; not held yet.
        Raises ValueError when the id is one this table holds."""
        self.validate(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise ValueError(f"request_id: {rid!r} is already in use")
        return Sequence(rid, list(prompt_token_ids), params, next(self._arrivals))

    def hold(self, seq: Sequence, detokenize: bool) -> None:
        self.seqs[seq.request_id] = seq
        self.detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer if detokenize else None, seq.params.stop)

    def forget(self, request_id: str) -> Sequence | None:
        """Drop a request; its sequence, or None when it was not held."""
        self.detok.pop(request_id, None)
        return self.seqs.pop(request_id, None)
