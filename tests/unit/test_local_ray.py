"""What `pdserve serve` and `pdserve router` decide about Ray before importing it: what
`--address auto` means, when the one-machine mode is needed, which running cluster is named (and
not joined), and the directory, token and ports of a serve's own Ray instance."""

from __future__ import annotations

import asyncio
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster.local_ray import MAX_TEMP_DIR_BYTES, prepare
from pdserve.cluster.ray_address import (
    ONE_MACHINE_VAR,
    is_loopback,
    one_machine_env,
    recorded_address,
    resolve_address,
    running_cluster,
    wait_until_answers,
)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Short: Ray's socket paths under a temp directory are limited to 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="pdlr", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _state_file(root: Path, address: str) -> dict[str, str]:
    (root / "ray").mkdir(exist_ok=True)
    (root / "ray" / "ray_current_cluster").write_text(address + "\n")
    return {"RAY_TMPDIR": str(root)}


def test_auto_reads_ray_address_first_then_rays_state_file(tmp_path):
    env = _state_file(tmp_path, "127.0.0.1:6380")
    assert recorded_address(env) == ("127.0.0.1:6380", f"Ray's state file {tmp_path}/ray/ray_current_cluster")
    assert resolve_address("auto", env) == "127.0.0.1:6380"
    assert resolve_address("auto", env | {"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert resolve_address("10.0.0.2:6379", env) == "10.0.0.2:6379"
    assert resolve_address("ray://10.0.0.3:10001", env) == "ray://10.0.0.3:10001"  # Ray Client's, kept
    with pytest.raises(ValueError, match=r"^--address auto: no RAY_ADDRESS and no Ray state file"):
        resolve_address("auto", {"RAY_TMPDIR": str(tmp_path / "none")})
    with pytest.raises(ValueError, match=r"^--address: 'head' is not HOST:PORT"):
        resolve_address("head", {})


@pytest.mark.parametrize(
    "address, loopback",
    [("127.0.0.1:6379", True), ("127.0.0.5:1", True), ("ray://127.0.0.1:10001", True), ("localhost:6379", True), ("[::1]:6379", True),
     ("10.0.0.1:6379", False), ("head.example:6379", False), ("192.0.2.7", False)],
)
def test_loopback_addresses(address, loopback):
    assert is_loopback(address) is loopback


def test_one_machine_mode_for_a_local_cluster_and_a_loopback_address_only(tmp_path):
    assert one_machine_env(None, {}) == {ONE_MACHINE_VAR: "0"}
    assert one_machine_env("127.0.0.1:6379", {}) == {ONE_MACHINE_VAR: "0"}
    assert one_machine_env("auto", _state_file(tmp_path, "127.0.0.1:6379")) == {ONE_MACHINE_VAR: "0"}
    assert one_machine_env("10.0.0.1:6379", {}) == {}  # a real cluster: Ray's own address choice
    assert one_machine_env("127.0.0.1:6379", {ONE_MACHINE_VAR: "1"}) == {}  # the user's setting stands


def test_a_running_cluster_is_named_and_a_stale_record_is_not(tmp_path):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        env = _state_file(tmp_path, address)
        assert running_cluster(env) == (address, f"Ray's state file {tmp_path}/ray/ray_current_cluster")
    assert running_cluster(env) is None  # nothing answers there now
    assert running_cluster({"RAY_TMPDIR": str(tmp_path / "none")}) is None


def test_waiting_for_an_address_ends_when_it_answers_or_at_the_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"nothing answered at 127.0.0.1:{port} within 0.3 s"):
            asyncio.run(wait_until_answers(f"127.0.0.1:{port}", 0.3, interval_s=0.05))
        assert time.monotonic() - started < 2
        s.listen(1)
        asyncio.run(wait_until_answers(f"127.0.0.1:{port}", 2, interval_s=0.05))


def test_a_serves_own_ray_gets_a_private_directory_a_token_and_free_ports(tmp_path):
    a = prepare(None, {"RAY_TMPDIR": str(tmp_path)})
    b = prepare(None, {"RAY_TMPDIR": str(tmp_path)})
    try:
        assert a.temp_dir != b.temp_dir and a.temp_dir.parent == tmp_path and a.owns_temp_dir
        assert stat.S_IMODE(a.temp_dir.stat().st_mode) == 0o700
        assert a.token_path is not None and stat.S_IMODE(a.token_path.stat().st_mode) == 0o600
        assert len(a.token_path.read_text()) == 64 and a.token_path.read_text() != b.token_path.read_text()
        ports = {a.dashboard_agent_port, a.metrics_export_port, a.autoscaler_metrics_port, a.dashboard_metrics_port}
        assert len(ports) == 4 and not ports & {52365, 44217, 44227}
        env = a.environment()
        assert env["RAY_AUTH_TOKEN_PATH"] == str(a.token_path) and env["RAY_AUTH_MODE"] == "token"
        assert env["AUTOSCALER_METRIC_PORT"] == str(a.autoscaler_metrics_port) and env[ONE_MACHINE_VAR] == "0"
    finally:
        a.discard()
        b.discard()
    assert not a.temp_dir.exists() and not b.temp_dir.exists()


def test_a_given_directory_is_kept_and_a_given_token_used(tmp_path):
    given = prepare(str(tmp_path / "ray"), {"RAY_AUTH_TOKEN_PATH": "/etc/token"})
    given.discard()
    assert given.temp_dir.is_dir() and not given.owns_temp_dir  # the user's: not removed
    assert given.token_path is None and "RAY_AUTH_TOKEN_PATH" not in given.environment()


def test_a_directory_too_long_for_rays_sockets_is_refused_naming_the_flag(tmp_path):
    long_dir = tmp_path / ("d" * MAX_TEMP_DIR_BYTES)
    with pytest.raises(ValueError, match=r"^--ray-temp-dir: .* is too long for Ray's socket paths"):
        prepare(str(long_dir), {})
    assert not long_dir.exists()
    with pytest.raises(ValueError, match=r"^the system temp folder \(RAY_TMPDIR or TMPDIR\): "):
        prepare(None, {"RAY_TMPDIR": str(long_dir)})
