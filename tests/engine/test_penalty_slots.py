"""The penalties from state kept on the device (`PenaltySlots`) against the plain whole-vocabulary
reference, bit for bit: filled from the tokens, brought up to date by the new ones and by draws
still on the device, rebuilt when a slot went to another sequence; and an engine run with
arrivals, a resume, preemptions and overlapped steps gives, at every step, the logits of the
penalties rebuilt from the tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import logits_processing, penalty_slots, runner, sampler
from pdserve.engine.logits_processing import RowTokens, process_logits
from pdserve.engine.penalty_slots import PenaltySlots
from tests.engine.greedy_reference import mixed_prompts, step_with_arrivals
from tests.engine.penalty_reference import dense_penalties

PARAMS = [
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7),
    SamplingParams(),  # untouched
    SamplingParams(logit_bias={3: 2.5}),  # bias only
    SamplingParams(repetition_penalty=0.8, logit_bias={5: -1.0, 6: 4.0}),
    SamplingParams(frequency_penalty=-1.1, presence_penalty=0.9),
    SamplingParams(repetition_penalty=1.7, frequency_penalty=2.0),
]


class _Seq:
    """A stand-in for a sequence: only its identity matters to the slots."""


@pytest.mark.parametrize("with_pending", [False, True])
def test_slot_penalties_equal_the_whole_vocabulary_bit_for_bit_as_tokens_arrive(with_pending):
    vocab, rng = 64, np.random.default_rng(3)
    owners = [_Seq() for _ in PARAMS]
    tokens = [rng.integers(0, vocab, int(n)).tolist() for n in (30, 5, 9, 17, 40, 3)]
    tokens[4].append(vocab + 2)  # past the logits: penalized nowhere
    num_outputs = [12, 0, 4, 0, 25, 3]
    slots = PenaltySlots(vocab, torch.device("cpu"))
    for step in range(6):
        if step:  # 0, 1 or 2 new output tokens a row; the draw in flight of the last step lands
            for i, t in enumerate(tokens):
                new = rng.integers(0, vocab, int(rng.integers(0, 3))).tolist()
                if with_pending and pending is not None and int(pending[i]) < vocab:
                    new = [int(pending[i]), *new[:1]]
                t += new
                num_outputs[i] += len(new)
        logits = torch.from_numpy(rng.standard_normal((6, vocab), dtype=np.float32) * 3)
        pending = None
        if with_pending:
            pending = torch.from_numpy(rng.integers(0, vocab, 6))
            pending[1] = vocab  # no draw in flight for row 1
            pending[0] = tokens[0][-1]  # one it holds
        rows = [
            RowTokens(t, n, int(pending is not None and int(pending[i]) < vocab), owner=o)
            for i, (t, n, o) in enumerate(zip(tokens, num_outputs, owners))
        ]
        want = dense_penalties(logits, PARAMS, tokens, num_outputs, pending)
        got = process_logits(logits, PARAMS, rows, (), pending, slots=slots)
        assert torch.equal(got, want), step
        again = logits.clone()
        if step == 5:  # in place, the same; a row whose pending draw was not taken is refilled
            fresh = PenaltySlots(vocab, torch.device("cpu"))
            assert process_logits(again, PARAMS, rows, (), pending, inplace=True, slots=fresh) is again
            assert torch.equal(again, want)
    # Filled once per penalized row (0, 3, 4, 5); after that only new tokens were added, unless
    # a draw counted in flight was not the token that arrived (not in this engine; here too: the
    # arriving token is the pending one).
    assert slots.fills == 4


def test_rows_of_a_different_split_or_fewer_tokens_are_refilled():
    vocab = 16
    slots, owner = PenaltySlots(vocab, torch.device("cpu")), _Seq()
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)]
    logits = torch.linspace(-3, 3, vocab)[None, :].contiguous()
    for toks, n_out in (([1, 2, 3, 4], 2), ([1, 2, 3, 4, 4], 2), ([5, 6], 1), ([5, 6, 6, 7], 3)):
        got = process_logits(logits, params, [RowTokens(toks, n_out, owner=owner)], (), slots=slots)
        assert torch.equal(got, dense_penalties(logits, params, [toks], [n_out], None)), toks
    assert slots.fills == 3  # first, split moved, shorter; the last one only added


def test_slots_go_to_new_sequences_least_recently_used_first_and_the_table_grows_only_when_all_are_in_use(monkeypatch):
    monkeypatch.setattr(penalty_slots, "MIN_SLOTS", 2)
    vocab, rng = 32, np.random.default_rng(5)
    slots = PenaltySlots(vocab, torch.device("cpu"))
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3)
    owners = [_Seq() for _ in range(7)]
    tokens = {id(o): rng.integers(0, vocab, 6).tolist() for o in owners}
    for call, batch in enumerate(([0, 1], [2, 3], [0, 4], [1, 2, 3, 5, 6], [0, 1])):
        rows_owners = [owners[i] for i in batch]
        for o in rows_owners:
            tokens[id(o)].append(int(rng.integers(0, vocab)))
        toks = [tokens[id(o)] for o in rows_owners]
        logits = torch.from_numpy(rng.standard_normal((len(batch), vocab), dtype=np.float32))
        rows = [RowTokens(t, 3, owner=o) for t, o in zip(toks, rows_owners)]
        got = process_logits(logits, [params] * len(batch), rows, (), slots=slots)
        assert torch.equal(got, dense_penalties(logits, [params] * len(batch), toks, [3] * len(batch), None)), call
    assert slots.counts.shape[0] == 8  # 2, 4 (third call), 8 (a batch of five): never more than needed


def _checked(real, seen: dict):
    """`process_logits` that also runs the penalties rebuilt from the tokens (on a copy, first)
    and requires the same logits as from the device state, bit for bit."""

    def call(logits, params, rows, eos_token_ids, pending=None, inplace=False, slots=None):
        rebuilt = None
        if rows is not None and any(p.penalized for p in params):
            assert slots is not None, "the engine kept no device state for penalties"
            fresh = [dataclasses.replace(r, cache=None, owner=None) for r in rows]
            rebuilt = real(logits.clone(), params, fresh, eos_token_ids, pending)
        out = real(logits, params, rows, eos_token_ids, pending, inplace, slots)
        if rebuilt is not None:
            assert torch.equal(out, rebuilt)
            seen["steps"] += 1
            seen["pending"] += pending is not None
            seen["slots"] = slots
        return out

    return call


@pytest.mark.parametrize("overlap", [False, True])
def test_device_state_gives_the_rebuilt_logits_with_arrivals_resume_and_preemption(
    overlap, tiny_model_factory, check_blocks_freed, monkeypatch
):
    model_dir, hf_model = tiny_model_factory("llama")
    vocab = hf_model.config.vocab_size
    options = {"num_kv_blocks": 30, "block_size": 4, "max_num_seqs": 6, "overlap_decode": overlap}
    prompts = mixed_prompts(vocab, seed=19, lengths=(3, 9, 14, 20, 26, 11))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3)
    params = [
        greedy,
        SamplingParams(max_tokens=22, temperature=0.0, presence_penalty=0.8, logit_bias={prompts[1][0]: 1.5}),
        SamplingParams(max_tokens=20, temperature=0.9, seed=5, frequency_penalty=0.6, repetition_penalty=0.8),
        SamplingParams(max_tokens=18, temperature=0.0),  # plain, beside them
        SamplingParams(max_tokens=21, temperature=0.0, repetition_penalty=1.2, presence_penalty=-0.4, min_tokens=5),
    ]
    first = LLM(str(model_dir), device="cpu", dtype="float32", **options).generate([prompts[0]], greedy)[0].token_ids
    prompts = prompts[:5] + [prompts[0] + first[:6]]  # a resume: 6 tokens made elsewhere
    params = params + [greedy.after(6)]
    runs, seen = {}, {"steps": 0, "pending": 0, "slots": None}
    for name, on_device in (("device", True), ("tokens", False)):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", penalties_on_device=on_device, **options)
        check_blocks_freed(llm.engine)
        with monkeypatch.context() as m:
            if on_device:
                for module in (runner, sampler):
                    m.setattr(module, "process_logits", _checked(logits_processing.process_logits, seen))
            got = step_with_arrivals(llm.engine, prompts, params)
        runs[name] = [got[str(i)] for i in range(len(prompts))]
        if on_device:
            assert llm.engine.num_preemptions > 0
            if overlap:
                assert llm.engine.num_overlapped_steps > 10 and seen["pending"] > 10
    assert runs["device"] == runs["tokens"]
    assert seen["steps"] > 30
    # Each penalized sequence filled its slot once and kept it through its preemptions (a
    # preempted sequence recomputes its prompt but keeps its tokens).
    assert seen["slots"].fills == 5
