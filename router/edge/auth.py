"""API keys: who may call which plane. Pure policy; the gRPC interceptor and the HTTP middleware
(`router/edge/grpc_auth.py`, `router/edge/http_server.py`) are the mechanism that applies it.

Planes: `open` (health checks, so that probes need no secret), `data` (generation, the model
list), `admin` (the Admin service) and `any` (reflection: the key of either plane, so that grpcurl
can describe the service its key opens). With no data key configured the data plane is
open; once any key is configured the admin plane needs an admin key, and a data key is refused
there, so that a leaked client key cannot drain workers or read the cluster's state.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


class Plane(Enum):
    """Which key a call needs: none (`OPEN`), a data key, an admin key, or a key of either (`ANY`)."""
    OPEN = "open"
    DATA = "data"
    ADMIN = "admin"
    ANY = "any"


class Verdict(Enum):
    """What `ApiKeys.check` decided for one call."""
    ALLOWED = "allowed"
    MISSING = "missing"  # no credentials, or not a key of this server: UNAUTHENTICATED / 401
    WRONG_PLANE = "wrong_plane"  # a valid key of the other plane: PERMISSION_DENIED / 403


ENV_VAR = "PDSERVE_API_KEY"


@dataclass(frozen=True)
class ApiKeys:
    """The API keys of the data and admin planes (none: no authentication); `check` decides
    whether a presented token may call a plane."""
    # repr=False: a config printed or logged never shows a key.
    data: tuple[str, ...] = field(default=(), repr=False)
    admin: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for name, keys in (("api_key", self.data), ("admin_api_key", self.admin)):
            for k in keys:
                if not k or k != k.strip() or any(c.isspace() for c in k):
                    raise ValueError(f"{name}: a key must be non-empty and contain no whitespace")
        if set(self.data) & set(self.admin):
            raise ValueError("admin_api_key: the same key as an --api-key; the admin key must be its own")

    @property
    def enabled(self) -> bool:
        return bool(self.data or self.admin)

    def __repr__(self) -> str:
        return f"ApiKeys(data={len(self.data)} keys, admin={len(self.admin)} keys)"

    def check(self, plane: Plane, token: str | None) -> Verdict:
        """May a caller presenting `token` (None: nothing presented) use `plane`?"""
        if plane is Plane.OPEN:
            return Verdict.ALLOWED
        if plane in (Plane.DATA, Plane.ANY) and not self.data:
            # Keys only for the admin plane: the data plane stays as open as with none.
            return Verdict.ALLOWED
        if plane is Plane.ADMIN and not self.enabled:
            return Verdict.ALLOWED
        if token is None:
            return Verdict.MISSING
        if plane is Plane.ANY:
            return Verdict.ALLOWED if _matches(token, self.data) | _matches(token, self.admin) else Verdict.MISSING
        own, other = (self.data, self.admin) if plane is Plane.DATA else (self.admin, self.data)
        if _matches(token, own):
            return Verdict.ALLOWED
        return Verdict.WRONG_PLANE if _matches(token, other) else Verdict.MISSING


def _matches(token: str, keys: Iterable[str]) -> bool:
    """Constant time in the token's content: every key is compared, with no early exit."""
    presented = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key.encode())
    return found


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header value (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def grpc_plane(method: str) -> Plane:
    """The plane of a gRPC method, given as `/package.Service/Method`."""
    service = method.lstrip("/").split("/", 1)[0]
    if service == "grpc.health.v1.Health":
        return Plane.OPEN
    if service == "pdserve.v1.Admin":
        return Plane.ADMIN
    if service.startswith("grpc.reflection."):
        return Plane.ANY
    return Plane.DATA  # Inference, and anything added later: closed unless said otherwise


def http_plane(path: str) -> Plane:
    return Plane.OPEN if path == "/health" else Plane.DATA


def load_keys(flag_keys: Iterable[str], env_value: str | None, key_file: str | Path | None) -> tuple[str, ...]:
    """The data keys from every source: `--api-key` (repeatable), the comma-separated
    PDSERVE_API_KEY and `--api-key-file` (one key a line; blank lines and # comments skipped).
    Duplicates are dropped, order kept."""
    keys = [k.strip() for k in flag_keys]
    if env_value:
        keys += [k.strip() for k in env_value.split(",") if k.strip()]
    if key_file is not None:
        keys += read_key_file(key_file)
    return tuple(dict.fromkeys(k for k in keys if k))


def read_key_file(path: str | Path) -> list[str]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"api_key_file: cannot read {path}: {exc.strerror or exc}") from exc
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
