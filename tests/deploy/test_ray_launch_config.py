"""deploy/ray without starting Ray: cluster.yaml passes `ray up`'s own validation and starts every
node through launch.sh, and launch.sh refuses bad arguments in one line before anything starts."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "ray" / "launch.sh"
CLUSTER_YAML = ROOT / "deploy" / "ray" / "cluster.yaml"
SUBCOMMANDS = {"head", "worker", "serve", "status", "down"}


def launch_calls(commands: list[str]) -> list[list[str]]:
    return [shlex.split(c)[1:] for c in commands if c.split()[0].endswith("deploy/ray/launch.sh")]


def test_cluster_yaml_is_valid_for_ray_up_and_starts_the_pools_with_the_script():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(prepare_config(raw))  # what `ray up` does before touching a machine
    head = launch_calls(raw["head_start_ray_commands"])
    workers = launch_calls(raw["worker_start_ray_commands"])
    assert [c[0] for c in head] == ["down", "head"] and [c[0] for c in workers] == ["down", "worker"]
    assert head[1][head[1].index("--pool") + 1] == "prefill"
    assert workers[1][workers[1].index("--pool") + 1] == "decode"
    assert any(a.startswith("--autoscaling-config=") for a in head[1])  # the on-prem provider's monitor
    assert workers[1][workers[1].index("--address") + 1] == "$RAY_HEAD_IP:6379"
    # The token reaches every machine where launch.sh reads it.
    assert "~/.pdserve/ray/auth_token" in raw["file_mounts"]
    assert any("pip install" in c and "pdserve[cluster]" in c for c in raw["setup_commands"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["head", "--pool", "both"], "--pool: 'both' is not prefill, decode, any or none"),
        (["head", "--node-ip-address", "0.0.0.0"], "--node-ip-address: give this machine's address"),
        (["head", "--gpus", "many"], "--gpus: 'many' is not a GPU count"),
        (["worker", "--pool", "decode"], "worker: --address HEAD:PORT is required"),
        (["worker", "--address", "127.0.0.1:6379"], "a head on loopback takes no other node"),
        (["worker", "--address", "10.0.0.1:6379", "--node-ip-address", "10.0.0.2"], "no Ray token at "),
        (["serve", "--prefill", "1"], "serve: --address HEAD:PORT is required"),
        (["up"], "unknown command 'up' (head, worker, serve, status, down)"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, args, message):
    env = os.environ | {"PDSERVE_RAY_DIR": str(tmp_path / "state")}
    proc = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: ") and message in lines[0], proc.stderr


def test_down_with_nothing_started_is_a_no_op(tmp_path):
    env = os.environ | {"PDSERVE_RAY_DIR": str(tmp_path)}
    proc = subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "launch.sh: down\n", proc.stderr
