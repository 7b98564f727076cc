"""The router's listeners with keys, TLS and limits, over real sockets: the gRPC interceptor, the
HTTP middleware, certificate rotation without a restart, and mutual TLS. The router behind them is
a stand-in that echoes (the cluster test, tests/cluster/test_security.py, runs the real one)."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.edge.auth import ApiKeys
from pdserve.router.edge.grpc_server import start_grpc_server
from pdserve.router.edge.http_server import start_http_server
from pdserve.router.edge.limits import InputLimits
from pdserve.router.edge.tls import CertificateFiles, TlsConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from tests.tls_certs import CertAuthority

DATA, ADMIN = "test-data-key", "test-admin-key"
KEYS = ApiKeys(data=(DATA,), admin=(ADMIN,))
LIMITS = InputLimits(max_request_bytes=64 * 1024, max_stop_strings=2)


@dataclass(frozen=True)
class _Config:
    model_id: str = "echo"
    max_model_len: int = 64


class EchoRouter:
    """What the servers call of a Router: one chunk back, the prompt's text."""

    config = _Config()
    decode_policy = SimpleNamespace(workers=["decode-0"])  # a decode worker in placement: healthy
    tokenizer = None  # logprobs then show token ids as text

    async def generate(self, request: pb.GenerateRequest, *_: Any, **__: Any) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(text=request.prompt, finish_reason="stop", usage=pb.Usage(prompt_tokens=1))

    def model_info(self) -> pb.ModelInfo:
        return pb.ModelInfo(id="echo", max_model_len=64)

    async def cluster_stats(self) -> pb.ClusterStats:
        return pb.ClusterStats(down_workers=["none"])


ECHO: Any = EchoRouter()  # typed loosely: it stands in for a Router


def _md(key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


async def _grpc_code(coro: Any) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_grpc_keys_per_plane_and_health_open():
    async def scenario() -> None:
        server, port = await start_grpc_server(ECHO, "127.0.0.1", 0, keys=KEYS, limits=LIMITS)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                inf, admin = pbg.InferenceStub(ch), pbg.AdminStub(ch)
                models = pb.ListModelsRequest()
                assert await _grpc_code(inf.ListModels(models)) == grpc.StatusCode.UNAUTHENTICATED
                assert await _grpc_code(inf.ListModels(models, metadata=_md("nope"))) == grpc.StatusCode.UNAUTHENTICATED
                assert await _grpc_code(inf.ListModels(models, metadata=_md(DATA))) == grpc.StatusCode.OK
                # A server-streaming call is refused the same way.
                gen = pb.GenerateRequest(prompt="hi")
                assert await _grpc_code(_drain(inf.Generate(gen))) == grpc.StatusCode.UNAUTHENTICATED
                assert await _grpc_code(_drain(inf.Generate(gen, metadata=_md(DATA)))) == grpc.StatusCode.OK
                stats = pb.GetStatsRequest()
                assert await _grpc_code(admin.GetStats(stats)) == grpc.StatusCode.UNAUTHENTICATED
                assert await _grpc_code(admin.GetStats(stats, metadata=_md(DATA))) == grpc.StatusCode.PERMISSION_DENIED
                assert (await admin.GetStats(stats, metadata=_md(ADMIN))).down_workers == ["none"]
                admin_on_data = inf.ListModels(models, metadata=_md(ADMIN))
                assert await _grpc_code(admin_on_data) == grpc.StatusCode.PERMISSION_DENIED
                health = health_pb2_grpc.HealthStub(ch)
                reply = await health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Inference"))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(scenario())


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def test_grpc_key_is_checked_before_the_method_is_looked_up_and_refusals_say_what_is_wrong():
    async def scenario() -> None:
        server, port = await start_grpc_server(ECHO, "127.0.0.1", 0, keys=KEYS, limits=LIMITS)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                # Without a key, an unknown method is refused like a known one: nothing about
                # which methods exist is learnt before the key.
                for name in ("/pdserve.v1.Inference/NoSuchMethod", "/no.such.Service/Call"):
                    unary = ch.unary_unary(name)
                    assert await _grpc_code(unary(b"")) == grpc.StatusCode.UNAUTHENTICATED
                    assert await _grpc_code(unary(b"", metadata=_md(DATA))) == grpc.StatusCode.UNIMPLEMENTED
                    streaming = ch.unary_stream(name)
                    assert await _grpc_code(_drain(streaming(b""))) == grpc.StatusCode.UNAUTHENTICATED
                inf, admin = pbg.InferenceStub(ch), pbg.AdminStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await inf.ListModels(pb.ListModelsRequest(), metadata=_md(ADMIN))
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "admin API key" in err.value.details() and "data-plane API key" in err.value.details()
                assert "Admin service" not in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await admin.GetStats(pb.GetStatsRequest(), metadata=_md(DATA))
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "may not call the Admin service" in err.value.details()
                # The health service stays open.
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_grpc_limits_name_the_field_and_cap_the_message():
    async def scenario() -> None:
        server, port = await start_grpc_server(ECHO, "127.0.0.1", 0, limits=LIMITS)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                inf = pbg.InferenceStub(ch)
                req = pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(stop=["a", "b", "c"]))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _drain(inf.Generate(req))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith("sampling_params.stop: 3 stop strings")
                big = pb.GenerateRequest(prompt="x" * (LIMITS.max_request_bytes + 1))
                assert await _grpc_code(_drain(inf.Generate(big))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_http_keys_limits_and_openai_error_shape():
    async def scenario() -> None:
        runner, port = await start_http_server(ECHO, "127.0.0.1", 0, keys=KEYS, limits=LIMITS)
        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {DATA}"}
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{base}/health") as r:
                    assert r.status == 200
                for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": DATA}):
                    async with s.get(f"{base}/v1/models", headers=headers) as r:
                        body = await r.json()
                        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
                        assert body["error"]["code"] == "invalid_api_key" and DATA not in json.dumps(body)
                async with s.get(f"{base}/no/such/route") as r:
                    assert r.status == 401  # routes are not revealed before the key
                async with s.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                    assert r.status == 403
                async with s.get(f"{base}/v1/models", headers=auth) as r:
                    assert r.status == 200
                ok = {"model": "echo", "prompt": "hi", "max_tokens": 1}
                async with s.post(f"{base}/v1/completions", json=ok, headers=auth) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["text"] == "hi"
                async with s.post(f"{base}/v1/completions", json=ok | {"stop": ["a", "b", "c"]}, headers=auth) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "stop"
                big = ok | {"prompt": "x" * LIMITS.max_request_bytes}
                async with s.post(f"{base}/v1/completions", json=big, headers=auth) as r:
                    assert r.status == 413 and (await r.json())["error"]["param"] == "body"
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def _serial_seen(port: int, ca: Path, client: tuple[Path, Path] | None = None) -> int:
    """The serial number of the certificate the server presents to a new connection."""
    from cryptography import x509

    ctx = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        ctx.load_cert_chain(*client)
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der).serial_number


def _rotate(ca: CertAuthority, cert: Path, key: Path) -> int:
    """Write a new certificate over the served files, as a rotation does; returns its serial."""
    from cryptography import x509

    tmp_cert, tmp_key = ca.issue("localhost", cert_path=cert.with_suffix(".new"), key_path=key.with_suffix(".new"))
    serial = x509.load_pem_x509_certificate(tmp_cert.read_bytes()).serial_number
    shutil.move(tmp_key, key)
    shutil.move(tmp_cert, cert)
    return serial


def test_http_tls_certificate_rotates_without_restart(tmp_path):
    ca = CertAuthority(tmp_path)
    cert, key = ca.issue("localhost")
    files = CertificateFiles(TlsConfig(str(cert), str(key)))

    async def scenario() -> None:
        runner, port = await start_http_server(ECHO, "127.0.0.1", 0, tls=files)
        try:
            first = await asyncio.to_thread(_serial_seen, port, ca.ca_path)
            new = _rotate(ca, cert, key)
            assert new != first
            assert await asyncio.to_thread(_serial_seen, port, ca.ca_path) == new
            async with aiohttp.ClientSession() as s:
                ctx = ssl.create_default_context(cafile=str(ca.ca_path))
                async with s.get(f"https://localhost:{port}/health", ssl=ctx) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_half_written_rotation_keeps_the_old_certificate(tmp_path):
    ca = CertAuthority(tmp_path)
    cert, key = ca.issue("localhost")
    files = CertificateFiles(TlsConfig(str(cert), str(key)))
    old = files.current
    other_cert, _ = ca.issue("other")
    shutil.copy(other_cert, cert)  # the certificate is new, its key not yet
    assert not files.refresh() and files.current == old
    _, other_key = ca.issue("other")  # reissue: a fresh pair
    shutil.copy(tmp_path / "other.pem", cert)
    shutil.copy(other_key, key)
    assert files.refresh() and files.current != old and files.generation == 1
    assert not files.refresh()  # nothing changed since


def test_grpc_mutual_tls_and_rotation(tmp_path):
    ca = CertAuthority(tmp_path / "a", "CA one")
    cert, key = ca.issue("localhost")
    client_cert, client_key = ca.issue("client", server=False)
    files = CertificateFiles(TlsConfig(str(cert), str(key), str(ca.ca_path)))
    ca_pem = ca.ca_path.read_bytes()

    async def status(creds: grpc.ChannelCredentials) -> grpc.StatusCode:
        opts = [("grpc.ssl_target_name_override", "localhost")]
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=opts) as ch:
            call = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return await _grpc_code(call)

    async def scenario() -> None:
        nonlocal port
        server, port = await start_grpc_server(ECHO, "127.0.0.1", 0, tls=files)
        try:
            with_cert = grpc.ssl_channel_credentials(ca_pem, client_key.read_bytes(), client_cert.read_bytes())
            assert await status(with_cert) == grpc.StatusCode.OK
            assert await status(grpc.ssl_channel_credentials(ca_pem)) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                plain = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert await _grpc_code(plain) == grpc.StatusCode.UNAVAILABLE
            # Rotate to a certificate of the same CA: new connections get it, clients go on working.
            new = _rotate(ca, cert, key)
            assert await status(with_cert) == grpc.StatusCode.OK
            assert await asyncio.to_thread(_serial_seen, port, ca.ca_path, (client_cert, client_key)) == new
        finally:
            await server.stop(0)

    port = 0
    asyncio.run(scenario())
