"""`pdserve serve --max-prefill-queue-tokens N` warns, before anything starts, when nothing bounds
what an overflowed prompt costs a decode worker's streams (no `--itl-target-ms`, no
`--max-prefill-tokens-with-decodes`): alone, overflow put whole prompts into decode steps and
the streams missed a 12 ms ITL SLO on 2 H200s (docs/serving-gpu.md)."""

from __future__ import annotations

import pytest

from pdserve.cli import _build_parser
from pdserve.cluster import main
from pdserve.cluster.startup_lines import overflow_warning


def test_overflow_alone_is_warned_about_and_bounded_overflow_is_not():
    assert overflow_warning(4096, None, None).startswith("warning: --max-prefill-queue-tokens without --itl-target-ms")
    assert overflow_warning(4096, 10.0, None) is None
    assert overflow_warning(4096, None, 256) is None
    assert overflow_warning(0, None, None) is None  # overflow off


@pytest.mark.parametrize(
    "flags, warned",
    [
        (["--max-prefill-queue-tokens", "4096"], True),
        (["--max-prefill-queue-tokens", "4096", "--itl-target-ms", "10"], False),
        (["--max-prefill-queue-tokens", "4096", "--max-prefill-tokens-with-decodes", "256"], False),
        ([], False),
    ],
)
def test_serve_says_it_on_stderr_before_starting(flags, warned, capsys):
    args = _build_parser().parse_args(["serve", *flags])
    cfg = main._checked(main.config_from_args(args), args)
    assert cfg.placement.max_prefill_queue_tokens == (4096 if flags else 0)
    err = capsys.readouterr().err
    assert ("pdserve: warning: --max-prefill-queue-tokens without --itl-target-ms" in err) == warned, err
