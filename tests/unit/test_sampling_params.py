"""`SamplingParams.after`: the one place that says how a request goes on after some of its
tokens were generated elsewhere (a decode worker recomputing, a stream resumed on another)."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams


def test_after_shrinks_the_budget_and_moves_the_seed_offset():
    p = SamplingParams(max_tokens=10, temperature=0.7, seed=5, stop=("x",), output_offset=2)
    q = p.after(3)
    assert (q.max_tokens, q.output_offset) == (7, 5)
    assert (q.temperature, q.seed, q.stop) == (0.7, 5, ("x",))
    assert q.after(4) == p.after(7)  # resuming twice is resuming once by the sum
    assert p.after(0) == p


@pytest.mark.parametrize("generated", [10, 11, -1])
def test_after_refuses_what_leaves_no_budget_or_is_negative(generated):
    with pytest.raises(ValueError, match="^generated:"):
        SamplingParams(max_tokens=10).after(generated)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e30}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("-inf")}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"stop": ["a\ud800"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    # Offline (`pdserve.LLM`) these are the only check; over the servers they back the edge's own.
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs)


def test_the_edges_of_the_ranges_are_accepted():
    p = SamplingParams(temperature=100.0, top_p=1e-9, seed=2**64 - 1, stop_token_ids=[2**32 - 1])
    assert (p.temperature, p.seed, p.stop_token_ids) == (100.0, 2**64 - 1, (2**32 - 1,))
    assert SamplingParams(temperature=0).greedy
