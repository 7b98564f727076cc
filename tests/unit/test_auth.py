"""API keys as policy: which plane a call is on, and who may call it."""

from __future__ import annotations

import pytest

from pdserve.router.edge.auth import ApiKeys, Plane, Verdict, bearer_token, grpc_plane, http_plane, load_keys

DATA, ADMIN = "data-key-1", "admin-key-1"


def test_no_keys_leaves_every_plane_open():
    keys = ApiKeys()
    assert not keys.enabled
    for plane in Plane:
        assert keys.check(plane, None) is Verdict.ALLOWED


def test_data_keys_guard_the_data_plane_and_close_the_admin_plane():
    keys = ApiKeys(data=(DATA, "data-key-2"))
    assert keys.check(Plane.OPEN, None) is Verdict.ALLOWED
    assert keys.check(Plane.DATA, None) is Verdict.MISSING
    assert keys.check(Plane.DATA, "wrong") is Verdict.MISSING
    assert keys.check(Plane.DATA, DATA) is Verdict.ALLOWED
    assert keys.check(Plane.DATA, "data-key-2") is Verdict.ALLOWED
    # No admin key configured: nobody may use Admin, least of all with a data key.
    assert keys.check(Plane.ADMIN, DATA) is Verdict.WRONG_PLANE
    assert keys.check(Plane.ADMIN, None) is Verdict.MISSING


def test_the_admin_key_opens_admin_only_and_a_data_key_is_refused_there():
    keys = ApiKeys(data=(DATA,), admin=(ADMIN,))
    assert keys.check(Plane.ADMIN, ADMIN) is Verdict.ALLOWED
    assert keys.check(Plane.ADMIN, DATA) is Verdict.WRONG_PLANE
    assert keys.check(Plane.DATA, ADMIN) is Verdict.WRONG_PLANE


def test_reflection_takes_the_key_of_either_plane():
    keys = ApiKeys(data=(DATA,), admin=(ADMIN,))
    assert keys.check(Plane.ANY, DATA) is Verdict.ALLOWED
    assert keys.check(Plane.ANY, ADMIN) is Verdict.ALLOWED
    assert keys.check(Plane.ANY, None) is Verdict.MISSING
    assert keys.check(Plane.ANY, "wrong") is Verdict.MISSING
    assert ApiKeys(admin=(ADMIN,)).check(Plane.ANY, None) is Verdict.ALLOWED  # as open as the data plane


def test_an_admin_key_alone_leaves_the_data_plane_open():
    keys = ApiKeys(admin=(ADMIN,))
    assert keys.check(Plane.DATA, None) is Verdict.ALLOWED
    assert keys.check(Plane.ADMIN, None) is Verdict.MISSING
    assert keys.check(Plane.ADMIN, ADMIN) is Verdict.ALLOWED


def test_keys_never_show_in_a_repr():
    keys = ApiKeys(data=(DATA,), admin=(ADMIN,))
    assert DATA not in repr(keys) and ADMIN not in repr(keys)
    from pdserve.cluster.serve_config import ServeConfig

    assert DATA not in repr(ServeConfig(api_keys=keys))


@pytest.mark.parametrize("bad", [(" padded",), ("",), ("two words",)])
def test_malformed_keys_are_refused(bad):
    with pytest.raises(ValueError, match="api_key"):
        ApiKeys(data=bad)


def test_the_admin_key_must_differ_from_every_data_key():
    with pytest.raises(ValueError, match="admin_api_key"):
        ApiKeys(data=(DATA,), admin=(DATA,))


@pytest.mark.parametrize(
    "header, token",
    [("Bearer abc", "abc"), ("bearer abc", "abc"), ("  Bearer   abc ", "abc"), ("Basic abc", None), ("Bearer", None),
     ("", None), (None, None)],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_planes_of_methods_and_paths():
    assert grpc_plane("/grpc.health.v1.Health/Check") is Plane.OPEN
    assert grpc_plane("/grpc.health.v1.Health/Watch") is Plane.OPEN
    assert grpc_plane("/pdserve.v1.Admin/GetStats") is Plane.ADMIN
    assert grpc_plane("/pdserve.v1.Inference/Generate") is Plane.DATA
    assert grpc_plane("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is Plane.ANY
    assert grpc_plane("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo") is Plane.ANY
    assert http_plane("/health") is Plane.OPEN
    assert http_plane("/v1/models") is Plane.DATA
    assert http_plane("/v1/completions") is Plane.DATA
    assert http_plane("/metrics") is Plane.DATA  # not served here: /metrics has its own port


def test_keys_come_from_flags_environment_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# rotated monthly\nfile-key-1\n\n  file-key-2  \nflag-key\n")
    keys = load_keys(["flag-key"], "env-key-1, env-key-2,,", f)
    assert keys == ("flag-key", "env-key-1", "env-key-2", "file-key-1", "file-key-2")


def test_an_unreadable_key_file_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="api_key_file"):
        load_keys([], None, tmp_path / "missing")
