"""The notices between the two ends of a KV transfer, as NIXL notifications. Both ends use these
functions, so the formats live here only.

- ``pulled:<request id>``: the consumer has read a request's KV; the producer frees it.
- ``progress:<KvProgress>``: the producer says more of a prompt's blocks are final while the
  prompt is still being prefilled (`--kv-transfer-overlap`); the consumer may read them now.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from pdserve.kv_transfer.transport import KvTransport
from pdserve_proto import kv_pb2

_PULLED = b"pulled:"
_PROGRESS = b"progress:"


def pulled_notice(request_id: str) -> bytes:
    return _PULLED + request_id.encode()


def pulled_request(notice: bytes) -> str | None:
    """The request id of a ``pulled`` notice; None for any other notice."""
    return notice[len(_PULLED):].decode() if notice.startswith(_PULLED) else None


def progress_notice(progress: kv_pb2.KvProgress) -> bytes:
    return _PROGRESS + progress.SerializeToString()


def progress_of(notice: bytes) -> kv_pb2.KvProgress | None:
    """The `KvProgress` of a ``progress`` notice; None for any other notice, or a garbled one
    (the consumer then reads those blocks when the handle comes, as without progress)."""
    if not notice.startswith(_PROGRESS):
        return None
    try:
        return kv_pb2.KvProgress.FromString(notice[len(_PROGRESS):])
    except DecodeError:
        return None


def send_notice(transport: KvTransport, agent_name: str, notice: bytes, timeout_s: float) -> None:
    """Send `notice` to a connected peer: a READ of no blocks only delivers its notice
    (`KvTransport.read`). Raises KvTransferError as a READ does."""
    transport.read(agent_name, [], [], notice, timeout_s)
