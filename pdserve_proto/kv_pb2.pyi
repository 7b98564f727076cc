from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvHandle(_message.Message):
    __slots__ = ("protocol_version", "request_id", "worker_id", "agent_name", "block_ids", "block_hashes", "num_tokens", "lease_deadline", "compat_hash", "block_checksums")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    request_id: str
    worker_id: str
    agent_name: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_deadline: float
    compat_hash: str
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, protocol_version: _Optional[int] = ..., request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_deadline: _Optional[float] = ..., compat_hash: _Optional[str] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class KvProgress(_message.Message):
    __slots__ = ("request_id", "agent_name", "first_block", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    agent_name: str
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvAgentInfo(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "agent_name", "agent_metadata", "compat_hash", "pool_address", "block_bytes", "num_blocks", "device_id", "memory_type", "shards")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    POOL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    agent_name: str
    agent_metadata: bytes
    compat_hash: str
    pool_address: int
    block_bytes: int
    num_blocks: int
    device_id: int
    memory_type: str
    shards: _containers.RepeatedCompositeFieldContainer[KvShard]
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., compat_hash: _Optional[str] = ..., pool_address: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device_id: _Optional[int] = ..., memory_type: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[KvShard, _Mapping]]] = ...) -> None: ...

class KvShard(_message.Message):
    __slots__ = ("kv_heads", "offset", "block_bytes", "device_id")
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    kv_heads: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    block_bytes: int
    device_id: int
    def __init__(self, kv_heads: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., block_bytes: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...
