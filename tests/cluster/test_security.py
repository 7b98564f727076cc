"""A secured `pdserve serve` as a user starts it (mutual TLS, data and admin keys), met with the
clients users bring: grpcurl, the `openai` package and `pdserve generate --address`. Then a scan
of every listening socket of the server's process tree: nothing on a non-loopback address, and
neither of pdserve's ports answers a request without a key."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tls_certs import CertAuthority

pytestmark = pytest.mark.cluster

SMALL = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512"]
DATA, ADMIN = "cluster-data-key", "cluster-admin-key"


@dataclass(frozen=True)
class Secured:
    pid: int
    grpc: str  # 127.0.0.1:PORT
    http: str
    ca: Path
    client: tuple[Path, Path]  # certificate, key
    out: list[str]


def _reader(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line.rstrip("\n"))
    out.put(None)


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[Secured]:
    tmp = tmp_path_factory.mktemp("tls")
    ca = CertAuthority(tmp)
    cert, key = ca.issue("localhost")
    client = ca.issue("client", server=False)
    keys_file = tmp / "api-keys"
    keys_file.write_text(f"{DATA}\n")
    cmd = [
        sys.executable, "-m", "pdserve.cli", "serve", *SMALL, "--prefill", "1", "--decode", "1",
        "--port", "0", "--http-port", "0",
        "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(ca.ca_path),
        "--api-key-file", str(keys_file),
    ]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PDSERVE_ADMIN_API_KEY": ADMIN}
    env.pop("PDSERVE_API_KEY", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("listening: KV transfers" in line for line in out):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"pdserve serve exited ({proc.wait(30)}) early: {out}")
            out.append(line)
        grpc_addr = _address(out, "gRPC")
        http_addr = _address(out, "HTTP")
        yield Secured(proc.pid, grpc_addr, http_addr, ca.ca_path, client, out)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _address(out: list[str], what: str) -> str:
    for line in out:
        m = re.match(rf"pdserve: listening: {what} (\S+:\d+) \((.*)\)$", line)
        if m:
            return m.group(1)
    raise AssertionError(f"no {what} listener in {out}")


def test_start_up_lists_each_listener_and_its_protection(secured):
    listening = [line for line in secured.out if line.startswith("pdserve: listening: ")]
    assert "mutual TLS, API key" in next(line for line in listening if " gRPC " in line)
    assert "mutual TLS, API key" in next(line for line in listening if " HTTP " in line)
    assert "not authenticated" in next(line for line in listening if "KV transfers on lo " in line)
    assert not any(DATA in line or ADMIN in line for line in secured.out)  # keys are never printed


def _grpcurl(s: Secured, *args: str, key: str | None = None, client_cert: bool = True) -> subprocess.CompletedProcess:
    cmd = ["grpcurl", "-cacert", str(s.ca), "-servername", "localhost"]
    if client_cert:
        cmd += ["-cert", str(s.client[0]), "-key", str(s.client[1])]
    if key is not None:
        cmd += ["-H", f"authorization: Bearer {key}"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


def test_grpcurl_needs_the_client_certificate_and_a_key_per_plane(secured):
    gen = json.dumps({"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0}})
    ok = _grpcurl(secured, "-d", gen, secured.grpc, "pdserve.v1.Inference/Generate", key=DATA)
    assert ok.returncode == 0 and '"finish_reason": "length"' in ok.stdout, ok.stderr
    missing = _grpcurl(secured, "-d", gen, secured.grpc, "pdserve.v1.Inference/Generate", key=None)
    assert missing.returncode != 0 and "Unauthenticated" in missing.stderr, missing.stderr
    wrong = _grpcurl(secured, "-d", gen, secured.grpc, "pdserve.v1.Inference/Generate", key="not-a-key")
    assert "Unauthenticated" in wrong.stderr, wrong.stderr
    # The admin key opens Admin (reflection takes either key), and a data key does not.
    stats = _grpcurl(secured, "-d", "{}", secured.grpc, "pdserve.v1.Admin/GetStats", key=ADMIN)
    assert stats.returncode == 0 and '"workers"' in stats.stdout, stats.stderr
    denied = _grpcurl(secured, "-d", "{}", secured.grpc, "pdserve.v1.Admin/GetStats", key=DATA)
    assert denied.returncode != 0 and "PermissionDenied" in denied.stderr, denied.stderr
    no_cert = _grpcurl(secured, "-d", gen, secured.grpc, "pdserve.v1.Inference/Generate", key=DATA, client_cert=False)
    assert no_cert.returncode != 0 and "finish_reason" not in no_cert.stdout


def test_health_checks_need_no_key(secured):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = grpc.ssl_channel_credentials(secured.ca.read_bytes(), secured.client[1].read_bytes(),
                                         secured.client[0].read_bytes())
    with grpc.secure_channel(secured.grpc, creds, options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Inference"),
                                                     timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _tls_context(s: Secured) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(s.ca))
    ctx.load_cert_chain(*s.client)
    return ctx


def test_openai_client_over_mutual_tls_with_the_key(secured):
    import openai

    _, port = secured.http.rsplit(":", 1)
    base = f"https://localhost:{port}/v1"
    with openai.DefaultHttpxClient(verify=_tls_context(secured)) as http:
        client = openai.OpenAI(base_url=base, api_key=DATA, http_client=http, max_retries=0)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
        assert done.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=base, api_key="not-a-key", http_client=http, max_retries=0).models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_pdserve_generate_with_key_and_certificates(secured):
    base = [sys.executable, "-m", "pdserve.cli", "generate", "--address", secured.grpc, "--max-tokens", "2",
            "--json", "--raw", "--ssl-ca-certs", str(secured.ca), "--server-name", "localhost",
            "--ssl-certfile", str(secured.client[0]), "--ssl-keyfile", str(secured.client[1]), "Hello"]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    ok = subprocess.run([*base, "--api-key", DATA], capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["finish_reason"] == "length", ok.stderr
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


# ----- the socket scan --------------------------------------------------------------------------


def _process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, []))
    return tree


def _socket_inodes(pids: set[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:
            continue
    return inodes


def _hex_address(hex_addr: str) -> tuple[str, int]:
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    # /proc/net/tcp6 writes each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening_sockets(pids: set[int]) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of every listening TCP and bound UDP socket the processes hold."""
    inodes = _socket_inodes(pids)
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        rows = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if inode in inodes and (state == "0A" if proto.startswith("tcp") else True):
                found.append((proto, *_hex_address(local)))
    return found


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_every_listener_of_the_process_tree_is_on_loopback(secured):
    pids = _process_tree(secured.pid)
    assert len(pids) > 3, pids  # the server, Ray's processes and the two workers
    sockets = listening_sockets(pids)
    ports = {port for _, _, port in sockets}
    assert int(secured.grpc.rsplit(":", 1)[1]) in ports and int(secured.http.rsplit(":", 1)[1]) in ports
    exposed = [s for s in sockets if not _loopback(s[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_no_pdserve_port_answers_without_a_key(secured):
    # With the client certificate (so TLS itself lets the call through), but no key.
    _, grpc_port = secured.grpc.rsplit(":", 1)
    for method, body in (("pdserve.v1.Inference/ListModels", "{}"), ("pdserve.v1.Admin/GetStats", "{}")):
        r = subprocess.run(
            ["grpcurl", "-cacert", str(secured.ca), "-servername", "localhost", "-cert", str(secured.client[0]),
             "-key", str(secured.client[1]), "-import-path", str(Path(__file__).resolve().parents[2] / "proto"),
             "-proto", "pdserve_proto/inference.proto", "-d", body, secured.grpc, method],
            capture_output=True, text=True, timeout=120,
        )
        assert r.returncode != 0 and "Unauthenticated" in r.stderr, (method, r.stderr)
    import urllib.error
    import urllib.request

    _, http_port = secured.http.rsplit(":", 1)
    for path in ("/v1/models", "/v1/completions", "/"):
        req = urllib.request.Request(f"https://localhost:{http_port}{path}")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, context=_tls_context(secured), timeout=30)
        assert err.value.code == 401, path
    # Without the client certificate the handshake itself fails: mutual TLS on HTTP as on gRPC.
    no_cert = ssl.create_default_context(cafile=str(secured.ca))
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        urllib.request.urlopen(f"https://localhost:{http_port}/health", context=no_cert, timeout=30).read()
