"""bench/decode_kernels.py's sweep inputs without a GPU: a serving batch's spread of contexts."""

from __future__ import annotations

import statistics

import pytest

from bench import decode_kernels
from bench.decode_kernels import context_lengths


def test_contexts_are_equal_without_a_spread():
    assert context_lengths(5, 1200, 0.0, seed=3) == [1200] * 5


def test_a_spread_draws_contexts_around_the_median_within_bounds_the_same_for_a_seed():
    lens = context_lengths(400, 1200, 0.5, seed=3)
    assert lens == context_lengths(400, 1200, 0.5, seed=3) != context_lengths(400, 1200, 0.5, seed=4)
    assert all(16 <= n <= 4800 for n in lens) and len(lens) == 400
    assert 1050 <= statistics.median(lens) <= 1350  # lognormal: the median is the context
    assert max(lens) > 2 * 1200 and min(lens) < 1200 / 2  # sigma 0.5: a wide batch, as chat's


def test_a_sweep_flag_that_is_not_integers_is_refused_naming_it(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["decode_kernels.py", "--attention-splits", "--sweep-batches", "16,x"])
    with pytest.raises(SystemExit) as exc:
        decode_kernels.main()
    assert exc.value.code == 2 and "--sweep-batches" in capsys.readouterr().err
