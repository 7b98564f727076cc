"""What `pdserve serve` says about its listeners, and where the KV transfers may listen."""

from __future__ import annotations

import pytest

from pdserve.cluster.listeners import check_required_key, exposure_warning, is_loopback, kv_net_devices, listener_lines
from pdserve.cluster.serve_config import ServeConfig
from pdserve.router.edge.auth import ApiKeys


def test_kv_transfers_stay_on_loopback_for_a_local_cluster():
    assert kv_net_devices(ServeConfig(), {}) == "lo"
    assert kv_net_devices(ServeConfig(kv_net_devices="eth1"), {}) == "eth1"
    # Workers spread over a Ray cluster's hosts: UCX picks, unless told.
    assert kv_net_devices(ServeConfig(ray_address="10.0.0.1:6379"), {}) is None
    assert kv_net_devices(ServeConfig(ray_address="10.0.0.1:6379", kv_net_devices="mlx5_0:1"), {}) == "mlx5_0:1"
    # The environment's own setting reaches UCX directly; pdserve does not override it.
    assert kv_net_devices(ServeConfig(), {"UCX_NET_DEVICES": "eth2"}) is None


def test_each_listener_is_listed_with_what_protects_it():
    lines = listener_lines(ServeConfig(), 50051, 8000, 9000, "lo")
    assert lines[0] == "listening: gRPC 127.0.0.1:50051 (plain TCP, no API key)"
    assert lines[1] == "listening: HTTP 127.0.0.1:8000 (plain TCP, no API key)"
    assert lines[2].startswith("listening: metrics 127.0.0.1:9000 (plain HTTP, no API key")
    assert "token authentication" in lines[3]
    assert lines[4] == "listening: token channels on 127.0.0.1 (a key per worker, handed over Ray)"
    assert lines[5] == "listening: KV transfers on lo (not authenticated: keep this network isolated)"
    over_ray = listener_lines(ServeConfig(token_transport="ray"), 50051, None, None, "lo")
    assert not any("token channel" in line for line in over_ray)
    keyed = ServeConfig(api_keys=ApiKeys(data=("k",)))
    grpc_line = listener_lines(keyed, 1, None, None, "lo")[0]
    assert "API key" in grpc_line and "refused, no --admin-api-key" in grpc_line


def test_an_open_listener_beyond_loopback_gets_a_warning():
    open_lines = listener_lines(ServeConfig(host="0.0.0.0"), 1, None, None, None)
    assert any(line.startswith("warning: ") and "no --api-key" in line for line in open_lines)
    keyed = ServeConfig(host="0.0.0.0", api_keys=ApiKeys(data=("k",)))
    warnings = [line for line in listener_lines(keyed, 1, None, None, None) if line.startswith("warning: ")]
    assert len(warnings) == 1 and "in clear" in warnings[0]
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


def test_an_admin_key_alone_leaves_the_data_plane_open_and_says_so():
    admin_only = ServeConfig(host="0.0.0.0", api_keys=ApiKeys(admin=("a",)))
    lines = listener_lines(admin_only, 1, 2, None, None)
    assert "API key" not in lines[0] and "Inference open, no --api-key" in lines[0] and "Admin: admin key" in lines[0]
    assert "API key" not in lines[1] and "open, no --api-key" in lines[1]
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert len(warnings) == 1 and "no --api-key" in warnings[0] and "--require-api-key" in warnings[0]
    assert exposure_warning(admin_only) == warnings[0]
    # On loopback an open data plane is the default, not a warning.
    assert exposure_warning(ServeConfig(api_keys=ApiKeys(admin=("a",)))) is None
    assert exposure_warning(ServeConfig(host="::1")) is None
    assert exposure_warning(ServeConfig(host="10.1.2.3", api_keys=ApiKeys(data=("k",)))) is None


def test_require_api_key_refuses_an_open_listener_beyond_loopback():
    for host, keys in (("0.0.0.0", ApiKeys()), ("::", ApiKeys(admin=("a",))), ("10.1.2.3", ApiKeys())):
        with pytest.raises(ValueError, match="^--require-api-key: "):
            check_required_key(ServeConfig(host=host, api_keys=keys), required=True)
        check_required_key(ServeConfig(host=host, api_keys=keys), required=False)  # only a warning
    for host, keys in (("127.0.0.1", ApiKeys()), ("localhost", ApiKeys()), ("0.0.0.0", ApiKeys(data=("k",)))):
        check_required_key(ServeConfig(host=host, api_keys=keys), required=True)


def test_serve_with_require_api_key_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str], monkeypatch):
    from pdserve.cli import main

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    # Refused before anything starts: no Ray, no model.
    assert main(["serve", "--host", "0.0.0.0", "--admin-api-key", "a", "--require-api-key"]) == 2
    err = capsys.readouterr().err
    assert "pdserve: error: --require-api-key:" in err and "--admin-api-key alone does not count" in err
