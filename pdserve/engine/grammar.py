"""Structured output's mechanism: compile each request's `StructuredOutput` against the model's
vocabulary (once per spec: a bounded cache), keep a grammar matcher per sequence, and before each
draw set the logits of every token its grammar forbids to -inf, all rows in one bitmask pass.

A matcher holds nothing that the tokens do not: it is rebuilt from the request's output so far
(the tokens made elsewhere, now at the end of its prompt, then its own), so the state crosses
the prefill/decode split, a preemption and a decode failover as the tokens do. It is fed those
tokens lazily, before each mask; the grammar ends the output by allowing only EOS."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.grammar_spec import JSON_OBJECT_SCHEMA, StructuredOutput
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept, most recently used first


@dataclass
class MatcherState:
    """One sequence's matcher and how many of its output tokens it has taken."""

    seq: Sequence  # held, so that no later sequence can take its id() while this state lives
    matcher: Any  # xgrammar.GrammarMatcher
    fed: int = 0
    broken: bool = False  # a token its grammar refused: only EOS is allowed from then on


class GrammarMasks:
    """The structured output of one engine: `check` a request's spec when it arrives, `mask` the
    logits of a step's sampled rows. xgrammar is imported and the vocabulary read on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._batch: Any = None
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        # Compiles run on the callers' threads, outside the engine's lock (`LLMEngine.prepare`),
        # one at a time: the engine steps on while a large schema compiles.
        self._compile_lock = threading.Lock()
        self._states: dict[int, MatcherState] = {}  # id(Sequence) -> state; pruned to the step's rows
        self._bitmask: torch.Tensor | None = None
        self._eos_mask: torch.Tensor | None = None

    def check(self, spec: StructuredOutput | None) -> None:
        """Compile `spec` now (or find it compiled): ValueError naming the field if this model's
        vocabulary cannot serve it, so the request is refused before it is admitted."""
        if spec is not None:
            self.compiled(spec)

    def compiled(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec`, from the cache when it was compiled before. Safe
        from any thread."""
        with self._compile_lock:
            return self._compiled_locked(spec)

    def _compiled_locked(self, spec: StructuredOutput) -> Any:
        hit = self._compiled.get(spec)
        if hit is not None:
            self._compiled.move_to_end(spec)
            return hit
        compiler = self._compiler_for_vocab()
        kind = spec.kind
        try:
            if kind in ("json_schema", "json_object"):
                grammar = compiler.compile_json_schema(spec.json_schema or JSON_OBJECT_SCHEMA, any_whitespace=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                grammar = compiler.compile_grammar(spec.ebnf_of_choice())
            else:
                grammar = compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_output.{kind}: {str(exc).strip().splitlines()[-1]}") from None
        self._compiled[spec] = grammar
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return grammar

    def _compiler_for_vocab(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_output: this model has no tokenizer, so no grammar can be applied")
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        return self._compiler

    def mask(self, logits: torch.Tensor, items: list[ScheduledSeq], pending: dict[int, int] | None = None) -> bool:
        """Mask `logits` ([len(items), vocab], one row per sampled item) for the rows whose request
        has structured output; False, and nothing touched, when none has. `pending`: row -> its
        output token drawn by the step before, not in its sequence yet (a step launched behind
        that one); the matcher takes it as the next output token."""
        rows = [i for i, item in enumerate(items) if item.seq.params.structured_output is not None]
        live = {id(items[i].seq) for i in rows}
        for key in [k for k in self._states if k not in live]:
            del self._states[key]  # a request that left the batch: rebuilt from its tokens if it comes back
        if not rows:
            return False
        import xgrammar as xgr

        pending = pending or {}
        states = [self._state(items[i].seq, pending.get(i)) for i in rows]
        if self._bitmask is None or self._bitmask.shape[0] < len(items):
            bitmask = xgr.allocate_token_bitmask(max(len(items), 64), self.vocab_size)
            # Pinned for a device: its copy is then queued behind the forward, not waited for.
            self._bitmask = bitmask.pin_memory() if logits.is_cuda else bitmask
        bitmask = self._bitmask
        # A matcher that has ended (its EOS is the draw in flight: the row is dropped) allows EOS.
        done = [s.broken or s.matcher.is_terminated() for s in states]
        ok = [i for i, d in zip(rows, done) if not d]
        self._batch.batch_fill_next_token_bitmask(
            [s.matcher for s, d in zip(states, done) if not d], bitmask, indices=ok
        )
        for i, d in zip(rows, done):
            if d:
                bitmask[i].copy_(self._only_eos())
        xgr.apply_token_bitmask_inplace(
            logits, bitmask[: len(items)].to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
        )
        return True

    def _state(self, seq: Sequence, pending: int | None = None) -> MatcherState:
        """The sequence's matcher, fed every output token it has not taken yet, then `pending`
        (its next output token, not in the sequence yet)."""
        state = self._states.get(id(seq))
        if state is None or state.seq is not seq:
            import xgrammar as xgr

            compiled = self.compiled(seq.params.structured_output)  # type: ignore[arg-type]
            state = self._states[id(seq)] = MatcherState(seq, xgr.GrammarMatcher(compiled))
        new = output_since(seq, state.fed)
        if pending is not None:
            new = [*new, pending]
        for token in new:
            if not state.broken and not state.matcher.accept_token(token):
                # Not one of its own draws (the grammar allowed only tokens it accepts): a token
                # from outside, which the grammar cannot follow. End the output rather than guess.
                log.warning("request %s: token %d breaks its grammar; ending its output", seq.request_id, token)
                state.broken = True
        state.fed += len(new)
        return state

    def _only_eos(self) -> torch.Tensor:
        if self._eos_mask is None:
            words = [0] * ((self.vocab_size + 31) // 32)
            for t in self.eos_token_ids:
                words[t // 32] |= 1 << (t % 32)
            # The bitmask's words are int32: bit 31 is the sign bit.
            self._eos_mask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
        return self._eos_mask


def output_since(seq: Sequence, start: int) -> list[int]:
    """The tokens the request has generated from the `start`-th on: those made elsewhere (the
    last `output_offset` of its prompt, see `SamplingParams.output_offset`), then this engine's.
    Only the new ones are copied: a matcher fed so far costs its new tokens a step."""
    made_elsewhere = seq.params.output_offset
    own = seq.output_token_ids[max(0, start - made_elsewhere) :]
    if start >= made_elsewhere:
        return own
    prompt = seq.prompt_token_ids
    return prompt[len(prompt) - made_elsewhere + start :] + own
