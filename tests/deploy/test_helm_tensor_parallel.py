"""The chart's tensor-parallel widths per pool: `prefill.tensorParallelSize` / `decode.tensorParallelSize`
become `pdserve serve`'s --prefill/--decode-tensor-parallel-size, each pool's pods request their
workers' GPUs (one worker a pod by default), the worker counts passed as --prefill / --decode
count workers, not GPUs, and a width that is not a whole number of GPUs, or a pod that does not
hold whole workers, fails the render naming the value."""

from __future__ import annotations

import json
import shlex
from typing import Any

import helm_python as helm
import pytest
from helm_objects import NAMESPACE, one, render, serve_command
from helm_value_sets import VALUE_SETS

pytestmark = pytest.mark.deploy


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def groups(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"]}


def pod_gpus(group: dict[str, Any]) -> tuple[str, str, int]:
    """The pod's GPU request and limit, and the pool resource the Ray node offers."""
    res = group["template"]["spec"]["containers"][0]["resources"]
    offered = json.loads(json.loads(group["rayStartParams"]["resources"]))
    assert len(offered) == 1
    return res["requests"]["nvidia.com/gpu"], res["limits"]["nvidia.com/gpu"], next(iter(offered.values()))


@pytest.mark.parametrize(
    "name, widths, workers, gpus",
    [
        # prefill TP2 (one worker in a 2-GPU pod), 2 decode pods of TP1.
        ("tp_2_1", ("2", "1"), ("1", "2"), {"prefill": 2, "decode": 1}),
        # 2 prefill pods of TP1; 3 decode pods of 4 GPUs, each 2 workers of TP2: 6 decode workers.
        ("tp_1_2", ("1", "2"), ("2", "6"), {"prefill": 1, "decode": 4}),
    ],
)
def test_widths_become_the_serve_flags_and_the_pods_gpus(
    chart: helm.Chart, name: str, widths: tuple[str, str], workers: tuple[str, str], gpus: dict[str, int]
) -> None:
    objects = render(chart, VALUE_SETS[name])
    cmd = shlex.split(serve_command(objects))
    assert (flag(cmd, "--prefill-tensor-parallel-size"), flag(cmd, "--decode-tensor-parallel-size")) == widths
    assert (flag(cmd, "--prefill"), flag(cmd, "--decode")) == workers
    for role, g in groups(objects).items():
        assert pod_gpus(g) == (str(gpus[role]), str(gpus[role]), gpus[role]), role


def test_defaults_are_one_gpu_a_worker_and_width_one(chart: helm.Chart) -> None:
    objects = render(chart)
    cmd = shlex.split(serve_command(objects))
    assert flag(cmd, "--prefill-tensor-parallel-size") == flag(cmd, "--decode-tensor-parallel-size") == "1"
    assert (flag(cmd, "--prefill"), flag(cmd, "--decode")) == ("1", "1")
    assert {r: pod_gpus(g) for r, g in groups(objects).items()} == {r: ("1", "1", 1) for r in ("prefill", "decode")}


def test_the_notes_say_the_widths(chart: helm.Chart) -> None:
    notes = chart.render(values=VALUE_SETS["tp_1_2"], name="demo", namespace=NAMESPACE)["pdserve/templates/NOTES.txt"]
    assert "2 prefill and 6 decode workers of 1 and 2 GPUs each (tensor-parallel)" in notes


@pytest.mark.parametrize(
    "values, names",
    [
        ({"prefill": {"tensorParallelSize": 0}}, "/prefill/tensorParallelSize"),
        ({"decode": {"tensorParallelSize": -2}}, "/decode/tensorParallelSize"),
        ({"decode": {"tensorParallelSize": 1.5}}, "/decode/tensorParallelSize"),
        ({"prefill": {"tensorParallelSize": "2"}}, "/prefill/tensorParallelSize"),
        ({"prefill": {"tensorParallelSize": 32}}, "/prefill/tensorParallelSize"),
    ],
)
def test_a_width_not_a_whole_number_of_gpus_is_refused_naming_it(
    chart: helm.Chart, values: dict[str, Any], names: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values=values, name="demo", namespace=NAMESPACE)
    assert names in str(err.value)


def test_a_pod_must_hold_whole_workers(chart: helm.Chart) -> None:
    """Not expressible in the schema: the template refuses it with a message naming both values."""
    with pytest.raises(helm.HelmRenderError) as err:
        chart.render(values={"decode": {"tensorParallelSize": 2, "gpus": 3}}, name="demo", namespace=NAMESPACE)
    assert "decode.gpus: 3 GPUs a pod do not hold whole workers of decode.tensorParallelSize 2" in str(err.value)
    # A colocated chart still checks its (empty) prefill pool's values.
    with pytest.raises(helm.HelmRenderError, match="prefill.gpus: 1 GPUs a pod"):
        chart.render(values={"prefill": {"replicas": 0, "tensorParallelSize": 2, "gpus": 1}}, name="demo",
                     namespace=NAMESPACE)  # fmt: skip
