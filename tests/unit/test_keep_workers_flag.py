"""`pdserve serve --keep-workers`: off by default (a stop of `pdserve serve` stops the pools'
workers), on only with --address (the workers of a Ray instance the command starts itself stop
with it), refused otherwise before anything starts. The stop that leaves the workers serving,
and their adoption by the next `pdserve serve`, run in tests/cluster/test_workers_outlive_routers.py."""

from __future__ import annotations

import pytest

from pdserve.cli import _build_parser
from pdserve.cluster.main import config_from_args
from pdserve.cluster.serve_config import ServeConfig


def test_off_by_default_and_on_with_an_address() -> None:
    parser = _build_parser()
    assert config_from_args(parser.parse_args(["serve", "--address", "127.0.0.1:6379"])).keep_workers is False
    args = parser.parse_args(["serve", "--address", "127.0.0.1:6379", "--keep-workers"])
    assert config_from_args(args).keep_workers is True
    assert ServeConfig().keep_workers is False


def test_without_an_address_it_is_refused_naming_the_flag() -> None:
    args = _build_parser().parse_args(["serve", "--keep-workers"])
    with pytest.raises(ValueError, match=r"^--keep-workers: only with --address"):
        config_from_args(args)
