"""TLS for the router's listeners: certificate files that are read again when they change, so a
rotated certificate is served without a restart.

`CertificateFiles` is the unit that notices a change and loads a consistent set (a certificate
and key that do not match, as while a rotation has written one file but not yet the other, are
skipped until they do); the gRPC credentials and the aiohttp SSLContext are built on it.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsConfig:
    """Paths, as vLLM names its flags: --ssl-certfile, --ssl-keyfile, --ssl-ca-certs.
    With ca_certs set, clients must present a certificate that CA signed (mutual TLS)."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None

    def __post_init__(self) -> None:
        for name in ("certfile", "keyfile", "ca_certs"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"ssl_{name}: {path} is not a file")

    @property
    def mutual(self) -> bool:
        return self.ca_certs is not None


def tls_config(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> TlsConfig | None:
    """The TlsConfig of the three flags, or None for plain TCP; half a configuration is an error."""
    if certfile is None and keyfile is None:
        if ca_certs is not None:
            raise ValueError("ssl_ca_certs: needs --ssl-certfile and --ssl-keyfile (the server's own certificate)")
        return None
    if certfile is None or keyfile is None:
        raise ValueError("ssl_certfile, ssl_keyfile: give both, or neither")
    return TlsConfig(certfile, keyfile, ca_certs)


@dataclass(frozen=True)
class Certificates:
    """One consistent set of PEM bytes."""

    cert_chain: bytes
    private_key: bytes
    ca_certs: bytes | None


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def validate(certs: Certificates) -> None:
    """Raise ssl.SSLError (or ValueError) unless the key matches the certificate and the CA parses."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(ctx, certs)
    if certs.ca_certs is not None:
        ctx.load_verify_locations(cadata=certs.ca_certs.decode())


def _load_chain(ctx: ssl.SSLContext, certs: Certificates) -> None:
    # ssl loads a chain from files only; a private temporary file keeps the bytes just read (and
    # validated) the ones used, even if the files change again in between.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert.write_bytes(certs.cert_chain)
        key.touch(0o600)
        key.write_bytes(certs.private_key)
        ctx.load_cert_chain(cert, key)


class CertificateFiles:
    """The current certificates of a TlsConfig; `refresh()` reloads them when a file changed."""

    def __init__(self, cfg: TlsConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._stamps = self._read_stamps()
        self.current = self._read()
        try:
            validate(self.current)  # a bad set at start-up is the user's error, reported at once
        except ssl.SSLError as exc:
            raise ValueError(f"ssl_certfile, ssl_keyfile, ssl_ca_certs: do not load together: {exc}") from exc
        self.generation = 0  # counts reloads

    def _paths(self) -> list[str]:
        return [p for p in (self.cfg.certfile, self.cfg.keyfile, self.cfg.ca_certs) if p is not None]

    def _read_stamps(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(_stamp(p) for p in self._paths())

    def _read(self) -> Certificates:
        ca = Path(self.cfg.ca_certs).read_bytes() if self.cfg.ca_certs is not None else None
        return Certificates(Path(self.cfg.certfile).read_bytes(), Path(self.cfg.keyfile).read_bytes(), ca)

    def refresh(self) -> bool:
        """Reload if any file changed since the last load; True when new certificates were loaded.
        A set that does not validate (mid-rotation, or broken) keeps the old one in service."""
        with self._lock:
            try:
                stamps = self._read_stamps()
            except OSError:
                return False  # a file briefly missing while it is replaced
            if stamps == self._stamps:
                return False
            try:
                certs = self._read()
                validate(certs)
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning("TLS: certificate files changed but do not load yet (%s); serving the previous ones", exc)
                return False
            self._stamps, self.current = stamps, certs
            self.generation += 1
            log.info("TLS: certificate files reloaded")
            return True


def grpc_credentials(files: CertificateFiles) -> grpc.ServerCredentials:
    """Server credentials that ask `files` for a change at every new connection's handshake."""

    def config() -> grpc.ServerCertificateConfiguration:
        c = files.current
        return grpc.ssl_server_certificate_configuration([(c.private_key, c.cert_chain)], root_certificates=c.ca_certs)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        return config() if files.refresh() else None

    return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=files.cfg.mutual)


class ReloadingSSLContext:
    """An SSLContext for a server socket whose certificates follow `files`: every handshake
    checks the files, and a changed set goes into a new context that the connection switches to
    (the SNI callback runs for every ClientHello, with or without a server name)."""

    def __init__(self, files: CertificateFiles) -> None:
        self.files = files
        self._generation = files.generation
        self._ctx = self._build()
        self.context = self._build()  # what the listener is given; it only dispatches
        self.context.sni_callback = self._on_hello

    def _build(self) -> ssl.SSLContext:
        certs = self.files.current
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(ctx, certs)
        if certs.ca_certs is not None:
            ctx.load_verify_locations(cadata=certs.ca_certs.decode())
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def _on_hello(self, sock: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: ssl.SSLContext) -> None:
        self.files.refresh()
        if self.files.generation != self._generation:
            self._generation = self.files.generation
            self._ctx = self._build()
        sock.context = self._ctx
        return None
