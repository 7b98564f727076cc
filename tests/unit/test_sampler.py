"""Sampler: greedy, temperature, top-k, top-p, seeds; SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def draw(params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [sample(LOGITS, [params], [gen], gen).tokens[0] for _ in range(n)]


def test_greedy_is_argmax():
    assert draw(SamplingParams(temperature=0.0), 5) == [0] * 5
    assert draw(SamplingParams(temperature=1.0, top_k=1), 5) == [0] * 5


def test_temperature_sampling_follows_the_softmax():
    n = 20000
    counts = torch.bincount(torch.tensor(draw(SamplingParams(temperature=1.0), n)), minlength=6).float() / n
    expected = LOGITS[0].softmax(-1)
    # 5 standard errors of a binomial proportion: fails only if the distribution is wrong.
    tol = 5 * torch.sqrt(expected * (1 - expected) / n) + 1e-3
    assert torch.all((counts - expected).abs() < tol), (counts, expected)


def test_top_k_and_top_p_restrict_the_support():
    assert set(draw(SamplingParams(temperature=1.0, top_k=2), 500)) == {0, 1}
    p = LOGITS[0].softmax(-1)  # ~[0.56, 0.21, 0.13, ...]: top_p=0.7 keeps the first two tokens
    assert p[0] < 0.7 < p[0] + p[1]
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.7), 500)) == {0, 1}


def test_same_seed_same_tokens_different_seed_different_tokens():
    params = SamplingParams(temperature=1.0)
    assert draw(params, 50, seed=1) == draw(params, 50, seed=1)
    assert draw(params, 50, seed=1) != draw(params, 50, seed=2)


def test_logprobs_are_of_the_model_distribution():
    gen = torch.Generator().manual_seed(0)
    out = sample(LOGITS, [SamplingParams(temperature=0.0, logprobs=True)], [None], gen)
    tokens, logprobs = out.tokens, out.logprobs
    assert tokens == [0]
    assert logprobs is not None and abs(logprobs[0] - LOGITS[0].log_softmax(-1)[0].item()) < 1e-6


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"output_offset": -1}, "output_offset"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)
