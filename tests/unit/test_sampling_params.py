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
