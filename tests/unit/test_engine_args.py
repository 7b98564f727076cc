"""The engine settings are declared once (`EngineArgs`): `EngineConfig` extends them, `ServeConfig`
carries them whole, and every one has a flag on `pdserve serve` and `pdserve generate` whose value
reaches the engine unchanged - no field-by-field copies to fall out of step."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

import pytest
import torch

from pdserve.cli import _build_parser
from pdserve.cluster.main import config_from_args
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.workers import engine_config
from pdserve.engine.args import EngineArgs, engine_options
from pdserve.engine.config import EngineConfig

NAMES = [f.name for f in fields(EngineArgs)]


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _other_value(action: argparse.Action, default: Any) -> tuple[list[str], Any]:
    """Flags that set the action's field to a value other than its default, and that value."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[0]], True
    if isinstance(action, argparse._StoreConstAction):  # store_true / store_false: the flag alone
        return [action.option_strings[0]], action.const
    if action.choices:
        value = next(c for c in action.choices if c != default)
        return [action.option_strings[0], value], value
    value = 7 if default is None else default + 7
    return [action.option_strings[0], str(value)], value


def _non_default_flags(command: str) -> tuple[list[str], dict[str, Any]]:
    by_dest = {a.dest: a for a in _subparser(command)._actions}
    argv: list[str] = []
    expected: dict[str, Any] = {}
    for f in fields(EngineArgs):
        assert f.name in by_dest, f"{command}: no flag for EngineArgs.{f.name}"
        flags, expected[f.name] = _other_value(by_dest[f.name], f.default)
        argv += flags
    return argv, expected


def test_the_engine_settings_are_declared_once():
    own = set(ServeConfig.__annotations__)
    assert not own & set(NAMES), "ServeConfig must carry EngineArgs whole, as ServeConfig.engine"
    assert issubclass(EngineConfig, EngineArgs)
    assert not set(EngineConfig.__annotations__) & set(NAMES), "EngineConfig redeclares a setting of EngineArgs"
    for f in fields(EngineArgs):
        assert f.default is not MISSING, f"EngineArgs.{f.name}: every setting has a default"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_setting_has_a_flag_named_after_it(command):
    by_dest = {a.dest: a for a in _subparser(command)._actions}
    for name in NAMES:
        assert by_dest[name].option_strings, f"{command}: EngineArgs.{name} has no flag"
        # Unset flags leave the dataclass's defaults in charge, not a second copy in argparse.
        assert by_dest[name].default is argparse.SUPPRESS


def test_serve_flags_land_in_serve_config_engine_unchanged():
    argv, expected = _non_default_flags("serve")
    assert expected != engine_options(EngineArgs())  # every field moved off its default
    cfg = config_from_args(_build_parser().parse_args(["serve", *argv]))
    assert cfg.engine == EngineArgs(**expected)
    assert config_from_args(_build_parser().parse_args(["serve"])).engine == EngineArgs()


def test_generate_flags_give_the_same_engine_settings():
    argv, expected = _non_default_flags("generate")
    args = _build_parser().parse_args(["generate", "hello", *argv])
    assert EngineArgs.from_options(vars(args)) == EngineArgs(**expected)
    assert EngineArgs.from_options(vars(_build_parser().parse_args(["generate", "hello"]))) == EngineArgs()


def test_a_bad_engine_setting_is_refused_when_the_flags_are_read():
    with pytest.raises(ValueError, match="^block_size:"):
        config_from_args(_build_parser().parse_args(["serve", "--block-size", "0"]))
    with pytest.raises(ValueError, match="^max_num_seqs:"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match="^attention_backend:"):
        EngineArgs(attention_backend="xformers")
    with pytest.raises(ValueError, match="^load_format: must be auto or dummy, not 'gguf'"):
        EngineArgs(load_format="gguf")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_workers_engine_config_carries_the_servers_engine_settings(role, tmp_path):
    _, expected = _non_default_flags("serve")
    cfg = ServeConfig(num_prefill=2, num_decode=3, engine=EngineArgs(**expected))
    ec = engine_config(cfg, role, tmp_path, "cpu", torch.bfloat16)
    assert engine_options(ec) == expected
    assert (ec.model, ec.device, ec.dtype, ec.role) == (str(tmp_path), "cpu", torch.bfloat16, role)
    assert ec.workers_on_host == 5
    assert ec.detokenize is (role == "prefill")  # the router turns decode and colocated tokens into text


def test_batch_limits_come_from_the_device_when_unset():
    from pdserve.engine.args import CPU_LIMITS, LARGE_GPU_LIMITS, SMALL_GPU_LIMITS, default_batch_limits

    assert default_batch_limits("cpu") == CPU_LIMITS
    assert default_batch_limits("cuda", 80 << 30) == LARGE_GPU_LIMITS  # H100 80GB, H200
    assert default_batch_limits("cuda", 24 << 30) == SMALL_GPU_LIMITS
    assert default_batch_limits("cuda", None) == SMALL_GPU_LIMITS  # memory unknown: the cautious limits
    assert LARGE_GPU_LIMITS.max_num_seqs > SMALL_GPU_LIMITS.max_num_seqs > CPU_LIMITS.max_num_seqs


def test_an_engine_config_always_holds_numbers():
    from pdserve.engine.args import CPU_LIMITS
    from pdserve.engine.config import EngineConfig

    cfg = EngineConfig(model="m", device="cpu")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (CPU_LIMITS.max_num_seqs, CPU_LIMITS.max_num_batched_tokens)
    cfg = EngineConfig(model="m", device="cpu", max_num_seqs=3)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (3, CPU_LIMITS.max_num_batched_tokens)


def test_decode_graphs_are_on_at_every_width_unless_enforce_eager():
    """Graphed decode steps are the default at width 1 and at width > 1 (an eager TP2 step is
    host-bound); `--enforce-eager` turns every graph off."""
    cfg = EngineConfig(model="m", tensor_parallel_size=2)
    assert cfg.use_cuda_graphs and cfg.tp_cuda_graphs
    serve = _subparser("serve")
    assert EngineArgs.from_options(vars(serve.parse_args([]))).use_cuda_graphs is True
    assert EngineArgs.from_options(vars(serve.parse_args(["--enforce-eager"]))).use_cuda_graphs is False
