"""The penalties' kept state (`PenaltyTokens`) against the tokens it derives from: kept between
steps it equals one rebuilt from the tokens, incrementally and after anything that breaks the
sequence; the sparse penalties equal the same arithmetic over the whole vocabulary, bit for bit,
pending tokens included; and an engine run with arrivals, a resume and preemptions gives, at
every step, the same logits and so the same tokens with the kept state as rebuilt at each step."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import logits_processing, runner, sampler
from pdserve.engine.logits_processing import RowTokens, process_logits
from pdserve.engine.penalty_tokens import PenaltyTokens
from tests.engine.greedy_reference import mixed_prompts, step_with_arrivals
from tests.engine.penalty_reference import dense_penalties


def _fresh(tokens: list[int], num_output: int) -> dict[int, int]:
    """Distinct token -> output count, plainly."""
    out = collections.Counter(tokens[len(tokens) - num_output :])
    return {t: out.get(t, 0) for t in set(tokens)}


def _as_dict(held: tuple[np.ndarray, np.ndarray]) -> dict[int, int]:
    tokens, counts = held
    assert len(set(tokens.tolist())) == len(tokens)  # each distinct token once
    return dict(zip(tokens.tolist(), counts.tolist()))


def test_kept_state_equals_the_tokens_as_they_grow_and_after_a_break():
    rng = np.random.default_rng(0)
    for trial in range(20):
        prompt_len = int(rng.integers(1, 40))
        tokens = rng.integers(0, 30, prompt_len).tolist()
        kept, made_before = PenaltyTokens(), int(rng.integers(0, 3))  # a resume: output in the prompt
        for _ in range(60):
            tokens += rng.integers(0, 30, int(rng.integers(0, 3))).tolist()  # 0, 1 or 2 per step
            num_output = len(tokens) - prompt_len + made_before
            assert _as_dict(kept.update(np.asarray(tokens), num_output)) == _fresh(tokens, num_output), trial
    # Tokens that do not continue what it holds (another sequence, another split) rebuild it.
    kept = PenaltyTokens()
    kept.update([1, 2, 3, 4], 2)
    assert _as_dict(kept.update([1, 2, 3, 4, 4], 2)) == {1: 0, 2: 0, 3: 0, 4: 2}  # split moved: rebuilt
    assert _as_dict(kept.update([5, 6], 1)) == {5: 0, 6: 1}  # shorter
    assert _as_dict(kept.update([5, 7, 7], 2)) == {5: 0, 7: 2}  # a token it took in changed


@pytest.mark.parametrize("with_pending", [False, True])
def test_sparse_penalties_equal_the_whole_vocabulary_bit_for_bit(with_pending):
    vocab, rng = 64, np.random.default_rng(3)
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7),
        SamplingParams(),  # untouched
        SamplingParams(logit_bias={3: 2.5}),  # bias only
        SamplingParams(repetition_penalty=0.8, logit_bias={5: -1.0, 6: 4.0}),
        SamplingParams(frequency_penalty=-1.1, presence_penalty=0.9),
        SamplingParams(repetition_penalty=1.7, frequency_penalty=2.0),
    ]
    tokens = [rng.integers(0, vocab, int(n)).tolist() for n in (30, 5, 9, 17, 40, 3)]
    tokens[4].append(vocab + 2)  # past the logits: penalized nowhere
    num_outputs = [12, 0, 4, 0, 25, 3]
    logits = torch.from_numpy(rng.standard_normal((6, vocab), dtype=np.float32) * 3)
    pending = None
    if with_pending:
        # Row 0's pending token is one it holds, row 4's one it does not; row 5 has none.
        pending = torch.tensor([tokens[0][-1], vocab, vocab, 7, 63, vocab])
        pending[4] = next(t for t in range(vocab) if t not in tokens[4])
    rows = [
        RowTokens(t, n, int(pending is not None and int(pending[i]) < vocab))
        for i, (t, n) in enumerate(zip(tokens, num_outputs))
    ]
    want = dense_penalties(logits, params, tokens, num_outputs, pending)
    got = process_logits(logits, params, rows, (), pending)
    assert torch.equal(got, want)
    # Kept state, warmed on a shorter past, gives the same; in place changes the tensor given.
    kept = [dataclasses.replace(r, cache=PenaltyTokens()) for r in rows]
    for r, t, n in zip(kept, tokens, num_outputs):
        r.cache.update(t[: len(t) - n // 2], n - n // 2)
    again = logits.clone()
    assert process_logits(again, params, kept, (), pending, inplace=True) is again
    assert torch.equal(again, want)


def test_a_pending_token_counts_once_in_its_own_entry_and_in_a_held_one():
    # vocab 10, two rows. Row 0 holds 3 (output count 2) and 5 (prompt only), row 1 holds 3 (1).
    # Their pending tokens: 3 (held by row 0) and 7 (new to row 1). Both entries of a token held
    # and pending must carry the same count: which of two writes to one place lands is not defined.
    entries = torch.tensor([[3, 5, 13, 0, 0], [0, 0, 1, 0, 1], [2, 0, 1, 1, 1]])
    logits_processing._count_pending(entries, torch.tensor([0, 10]), torch.tensor([0, 1]), torch.tensor([3, 7]))
    assert entries.tolist() == [[3, 5, 13, 3, 17], [0, 0, 1, 0, 1], [3, 0, 1, 3, 1]]


def _checked(real, seen: dict):
    """`process_logits` that also runs it rebuilt from the tokens (on a copy, first: the kept
    state is updated by the real call) and requires the same logits, bit for bit."""

    def call(logits, params, rows, eos_token_ids, pending=None, inplace=False, slots=None):
        assert slots is None, "on CPU the engine keeps penalties as tokens unless told otherwise"
        rebuilt = None
        if rows is not None and any(p.penalized for p in params):
            fresh = [dataclasses.replace(r, cache=None) for r in rows]
            rebuilt = real(logits.clone(), params, fresh, eos_token_ids, pending)
            seen["caches"].update({id(r.cache): r.cache for r, p in zip(rows, params) if p.penalized})
        out = real(logits, params, rows, eos_token_ids, pending, inplace)
        if rebuilt is not None:
            assert torch.equal(out, rebuilt)
            seen["steps"] += 1
            seen["pending"] += pending is not None
        return out

    return call


def _rebuilt(real):
    """`process_logits` without the kept state: every row rebuilt from its tokens."""

    def call(logits, params, rows, *args, **kwargs):
        rows = None if rows is None else [dataclasses.replace(r, cache=None) for r in rows]
        return real(logits, params, rows, *args, **kwargs)

    return call


@pytest.mark.parametrize("overlap", [False, True])
def test_kept_state_gives_the_rebuilt_tokens_with_arrivals_resume_and_preemption(
    overlap, tiny_model_factory, check_blocks_freed, monkeypatch
):
    model_dir, hf_model = tiny_model_factory("llama")
    vocab = hf_model.config.vocab_size
    options = {"num_kv_blocks": 30, "block_size": 4, "max_num_seqs": 6, "overlap_decode": overlap}
    prompts = mixed_prompts(vocab, seed=17, lengths=(3, 9, 14, 20, 26, 11))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3)
    params = [
        greedy,
        SamplingParams(max_tokens=22, temperature=0.0, presence_penalty=0.8, logit_bias={prompts[1][0]: 1.5}),
        SamplingParams(max_tokens=20, temperature=0.9, seed=5, frequency_penalty=0.6, repetition_penalty=0.8),
        SamplingParams(max_tokens=18, temperature=0.0),  # plain, beside them
        SamplingParams(max_tokens=21, temperature=0.0, repetition_penalty=1.2, presence_penalty=-0.4),
    ]
    # A resume: prompt 0 with 6 of its tokens made elsewhere (they count as output).
    first = LLM(str(model_dir), device="cpu", dtype="float32", **options).generate([prompts[0]], greedy)[0].token_ids
    prompts = prompts[:5] + [prompts[0] + first[:6]]
    params = params + [greedy.after(6)]
    runs, seen = {}, {"steps": 0, "pending": 0, "caches": {}}
    real_rebuild = PenaltyTokens._rebuild

    def counting_rebuild(self, tokens, split):
        self.rebuilds = getattr(self, "rebuilds", 0) + 1
        real_rebuild(self, tokens, split)

    monkeypatch.setattr(PenaltyTokens, "_rebuild", counting_rebuild)
    for name, wrap in (("kept", lambda real: _checked(real, seen)), ("rebuilt", _rebuilt)):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", **options)
        check_blocks_freed(llm.engine)
        with monkeypatch.context() as m:
            for module in (runner, sampler):
                m.setattr(module, "process_logits", wrap(logits_processing.process_logits))
            got = step_with_arrivals(llm.engine, prompts, params)
        runs[name] = [got[str(i)] for i in range(len(prompts))]
        if name == "kept":
            assert llm.engine.num_preemptions > 0
            if overlap:
                assert llm.engine.num_overlapped_steps > 10 and seen["pending"] > 10
    assert runs["kept"] == runs["rebuilt"]
    assert seen["steps"] > 30
    # Each sequence's state was built once and kept, through its preemptions, not rebuilt each step.
    assert len(seen["caches"]) == 5 and all(c.rebuilds == 1 for c in seen["caches"].values())
