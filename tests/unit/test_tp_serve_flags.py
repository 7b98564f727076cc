"""`pdserve serve`'s tensor-parallel widths: vLLM's `--tensor-parallel-size` (`-tp`) for both
pools, `--prefill-tensor-parallel-size` / `--decode-tensor-parallel-size` for one, and each
worker's engine built at its pool's width; a width below 1 is refused naming the field. The
hand-over between widths runs in tests/cluster/test_tp_handover.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.cli import _build_parser
from pdserve.cluster.main import config_from_args
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.workers import engine_config


def _widths(*argv: str) -> tuple[int, int]:
    cfg = config_from_args(_build_parser().parse_args(["serve", *argv]))
    return cfg.prefill_tensor_parallel_size, cfg.decode_tensor_parallel_size


def test_one_flag_for_both_pools_and_one_per_pool() -> None:
    assert _widths() == (1, 1)
    assert _widths("-tp", "2") == (2, 2)
    assert _widths("--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1") == (2, 1)
    assert _widths("--decode-tensor-parallel-size", "2") == (1, 2)


def test_each_worker_is_built_at_its_pools_width() -> None:
    cfg = ServeConfig(device="cpu", prefill_tensor_parallel_size=2, decode_tensor_parallel_size=1)
    widths = {role: engine_config(cfg, role, Path("m"), "cpu", torch.float32).tensor_parallel_size for role in ("prefill", "decode")}
    assert widths == {"prefill": 2, "decode": 1}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_width_below_one_is_refused_naming_the_field(role: str) -> None:
    with pytest.raises(ValueError, match=f"^{role}_tensor_parallel_size: must be >= 1"):
        ServeConfig(**{f"{role}_tensor_parallel_size": 0})
