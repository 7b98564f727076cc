"""The batched sampler against plain references: transformers' logits processors and warpers
row by row, OpenAI's penalties in plain torch, and seeded rows that draw the same alone and in
any batch."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from pdserve.engine.logits_processing import RowTokens, process_logits
from pdserve.engine.sampler import _filter_top_k_top_p, sample
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalties_and_bias_equal_references_row_by_row():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 14)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (0, 6, 11, 4)]
    params = [
        SamplingParams(repetition_penalty=1.4),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3),
        SamplingParams(),  # untouched in the batch
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0, logit_bias={3: 5.5, 7: -100}),
    ]
    rows = [RowTokens(p + o, len(o)) for p, o in zip(prompts, outputs)]
    logits = _logits(4)
    got = process_logits(logits, params, rows, eos_token_ids=())
    for i, (p, o, sp) in enumerate(zip(prompts, outputs, params)):
        ref = logits[i : i + 1].clone()
        for t, b in sp.logit_bias:
            ref[0, t] += b
        ids = torch.tensor([p + o])
        ref = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, ref) if sp.repetition_penalty != 1.0 else ref
        counts = torch.bincount(torch.tensor(o, dtype=torch.long), minlength=VOCAB).float()
        ref = ref - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[i], ref[0], rtol=0, atol=1e-6)
    assert torch.equal(got[2], logits[2])


def test_min_tokens_masks_eos_and_stop_ids_until_reached_counting_a_resume():
    logits = _logits(3)
    params = [
        SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[5]),
        SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[5]).after(2),  # 2 made elsewhere
    ]
    rows = [RowTokens([1, 2, 3], 3), RowTokens([1, 2, 3], 3), RowTokens([1, 2, 3, 4, 6], 4)]
    got = process_logits(logits, params, rows, eos_token_ids=(9,))
    assert math.isinf(got[0, 5]) and math.isinf(got[0, 9])
    assert math.isinf(got[1, 5]) and got[1, 9] == logits[1, 9]  # ignore_eos: EOS is no stop, left alone
    assert got[2, 5] == logits[2, 5] and got[2, 9] == logits[2, 9]  # 4 out: 2 here + 2 before
    assert sample(logits, params[:1], [None], torch.Generator(), rows[:1], (9,)).tokens[0] not in (5, 9)


@pytest.mark.parametrize("seed", range(5))
# With a row without top-k the whole vocabulary is sorted; with top-k on every row only the k largest.
@pytest.mark.parametrize(("ks", "ps"), [([3, -1, 10, 1], [1.0, 0.6, 0.3, 0.9]), ([3, 7, 10, 1], [1.0, 0.6, 0.3, 0.9])])
def test_batched_top_k_top_p_equal_transformers_warpers(seed, ks, ps):
    logits = _logits(4, seed)
    got = _filter_top_k_top_p(logits, ks, ps)
    for i, (k, p) in enumerate(zip(ks, ps)):
        ref = logits[i : i + 1]
        if k > 0:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref[0])), i
        torch.testing.assert_close(got[i][~torch.isinf(got[i])], ref[0][~torch.isinf(ref[0])])


def test_a_seeded_row_draws_the_same_in_any_batch():
    logits = _logits(5, 3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)

    def draw(batch_rows: list[int], at: int) -> int:
        params = [seeded if r == at else SamplingParams(temperature=1.0 + r / 10, top_k=5) for r in batch_rows]
        gens = [torch.Generator().manual_seed(7) if r == at else None for r in batch_rows]
        out = sample(logits[batch_rows], params, gens, torch.Generator().manual_seed(len(batch_rows)))
        return out.tokens[batch_rows.index(at)]

    alone = draw([2], 2)
    assert draw([0, 1, 2, 3, 4], 2) == alone == draw([4, 2], 2)


def test_top_logprobs_are_the_raw_distributions_best():
    logits = _logits(2, 5)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, logit_bias={0: 50}),
              SamplingParams(temperature=0.0, logprobs=True)]
    out = sample(logits, params, [None, None], torch.Generator())
    lp = logits.log_softmax(-1)
    assert out.tokens == [0, int(logits[1].argmax())]  # the bias picks the token ...
    assert out.logprobs is not None and abs(out.logprobs[0] - lp[0, 0].item()) < 1e-6  # ... not its logprob
    assert out.top_logprobs is not None and out.top_logprobs[1] == []
    assert [t for t, _ in out.top_logprobs[0]] == lp[0].topk(3).indices.tolist()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {1: float("nan")}}, r"logit_bias\[1\]"),
        ({"logit_bias": {1: 101}}, r"logit_bias\[1\]"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": 5}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
    ],
)
def test_bad_processing_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs)


def test_plain_params_process_nothing():
    logits = _logits(2)
    assert process_logits(logits, [SamplingParams(), SamplingParams(temperature=0)], None, ()) is logits
