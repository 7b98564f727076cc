"""deploy/ray without starting Ray: cluster.yaml passes `ray up`'s own validation and starts every
node through launch.sh, and launch.sh refuses bad arguments in one line before anything starts."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "ray" / "launch.sh"
CLUSTER_YAML = ROOT / "deploy" / "ray" / "cluster.yaml"
SUBCOMMANDS = ("head", "worker", "serve", "router", "status", "down")


def launch_calls(commands: list[str]) -> list[list[str]]:
    """The script's arguments in each command that runs it (after any VAR=value settings)."""
    calls = []
    for c in commands:
        words = shlex.split(c)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]
        if words and words[0].endswith("deploy/ray/launch.sh"):
            calls.append(words[1:])
    return calls


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
    assert not any("--user" in c for c in raw["setup_commands"])  # current Ubuntu refuses it (PEP 668)
    # Every start runs the script with the Python the set-up installed pdserve into.
    starts = raw["head_start_ray_commands"] + raw["worker_start_ray_commands"]
    assert all(c.startswith("PDSERVE_PYTHON=~/pdserve-venv/bin/python ") for c in starts), starts
    assert any(c.startswith("python3 -m venv ~/pdserve-venv") for c in raw["setup_commands"])


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
        (["up"], "unknown command 'up' (head, worker, serve, router, status, down)"),
        (["router", "--port", "0"], "router: --address HEAD:PORT is required"),
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


def test_help_is_on_stdout_with_exit_0_and_each_command_has_its_own(tmp_path):
    env = os.environ | {"PDSERVE_RAY_DIR": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, check=False, timeout=60)

    full = run("--help")
    assert full.returncode == 0 and full.stderr == "", full.stderr
    for sub in SUBCOMMANDS:
        assert f"launch.sh {sub}" in full.stdout, full.stdout
    for sub in SUBCOMMANDS:
        one = run(sub, "--help")
        assert one.returncode == 0 and one.stderr == "", (sub, one.stderr)
        lines = one.stdout.splitlines()
        assert lines[0] == "usage:" and lines[1].startswith(f" launch.sh {sub}"), (sub, one.stdout)
        assert not [line for line in lines[2:] if line.startswith(" launch.sh ")], (sub, one.stdout)  # only its own
    bare = run()
    assert bare.returncode == 2 and bare.stdout == "" and "launch.sh head" in bare.stderr


def _no_network_prefix() -> list[str]:
    """A command prefix that runs in a new network namespace (loopback only, no default route)."""
    for prefix in (["unshare", "--net"], ["unshare", "--map-root-user", "--net"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, check=False, timeout=30).returncode == 0:
                return prefix
        except OSError:
            break
    pytest.skip("no network namespace can be created here (needs root or unprivileged user namespaces)")


def test_a_host_without_a_default_route_gets_one_line_not_a_traceback(tmp_path):
    env = os.environ | {"PDSERVE_RAY_DIR": str(tmp_path / "state"), "PDSERVE_PYTHON": sys.executable}
    proc = subprocess.run(
        [*_no_network_prefix(), str(SCRIPT), "head", "--pool", "prefill"],
        env=env, capture_output=True, text=True, check=False, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("launch.sh: error: --node-ip-address: this machine has no route to 8.8.8.8"), lines
    assert not (tmp_path / "state" / "head.pid").exists()  # nothing started
