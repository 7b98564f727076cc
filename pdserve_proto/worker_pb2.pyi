from pdserve_proto import inference_pb2 as _inference_pb2
from pdserve_proto import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerError(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[WorkerError.Code]
        WRONG_ROLE: _ClassVar[WorkerError.Code]
        ENGINE_STOPPED: _ClassVar[WorkerError.Code]
        NO_FREE_BLOCKS: _ClassVar[WorkerError.Code]
        KV_INCOMPATIBLE: _ClassVar[WorkerError.Code]
        REQUEST_ENDED: _ClassVar[WorkerError.Code]
        DEADLINE_EXCEEDED: _ClassVar[WorkerError.Code]
        INVALID_REQUEST: _ClassVar[WorkerError.Code]
        INTERNAL: _ClassVar[WorkerError.Code]
    UNSPECIFIED: WorkerError.Code
    WRONG_ROLE: WorkerError.Code
    ENGINE_STOPPED: WorkerError.Code
    NO_FREE_BLOCKS: WorkerError.Code
    KV_INCOMPATIBLE: WorkerError.Code
    REQUEST_ENDED: WorkerError.Code
    DEADLINE_EXCEEDED: WorkerError.Code
    INVALID_REQUEST: WorkerError.Code
    INTERNAL: WorkerError.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: WorkerError.Code
    message: str
    def __init__(self, code: _Optional[_Union[WorkerError.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerSamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "output_offset", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "top_logprobs", "prompt_logprobs", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    output_offset: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    top_logprobs: int
    prompt_logprobs: int
    structured_output: _inference_pb2.StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., output_offset: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_inference_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "params", "request_id", "timeout_s", "trace_context", "progress_to", "router_id")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_TO_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WorkerSamplingParams
    request_id: str
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    progress_to: str
    router_id: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WorkerSamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., progress_to: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "router_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "params", "request_id", "prefilled", "trace_context", "router_id")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WorkerSamplingParams
    request_id: str
    prefilled: PrefillResult
    trace_context: _containers.ScalarMap[str, str]
    router_id: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WorkerSamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., prefilled: _Optional[_Union[PrefillResult, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., router_id: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "params", "request_id", "router_id")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WorkerSamplingParams
    request_id: str
    router_id: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WorkerSamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "params", "request_id", "trace_context", "router_id")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WorkerSamplingParams
    request_id: str
    trace_context: _containers.ScalarMap[str, str]
    router_id: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WorkerSamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., router_id: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "router_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class Freed(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("wait_s", "router_id", "acked")
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    router_id: str
    acked: int
    def __init__(self, wait_s: _Optional[float] = ..., router_id: _Optional[str] = ..., acked: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ("wait_s", "full", "router_id")
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    full: bool
    router_id: str
    def __init__(self, wait_s: _Optional[float] = ..., full: _Optional[bool] = ..., router_id: _Optional[str] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("handle", "first_token", "finish_reason", "cached_prompt_tokens", "queue_seconds", "first_logprob", "first_top_logprobs", "prompt_logprobs", "compute_seconds", "worker_seconds", "arrived_unix_s")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    handle: _kv_pb2.KvHandle
    first_token: int
    finish_reason: str
    cached_prompt_tokens: int
    queue_seconds: float
    first_logprob: float
    first_top_logprobs: _inference_pb2.TopLogprobs
    prompt_logprobs: _inference_pb2.PromptLogprobs
    compute_seconds: float
    worker_seconds: float
    arrived_unix_s: float
    def __init__(self, handle: _Optional[_Union[_kv_pb2.KvHandle, _Mapping]] = ..., first_token: _Optional[int] = ..., finish_reason: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., first_logprob: _Optional[float] = ..., first_top_logprobs: _Optional[_Union[_inference_pb2.TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_inference_pb2.PromptLogprobs, _Mapping]] = ..., compute_seconds: _Optional[float] = ..., worker_seconds: _Optional[float] = ..., arrived_unix_s: _Optional[float] = ...) -> None: ...

class DecodeStart(_message.Message):
    __slots__ = ("reused_tokens", "pulled_blocks", "recomputed", "transfer_bytes", "transfer_seconds", "transfer_retries", "prefetched_blocks", "waited_for_blocks_s")
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_RETRIES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITED_FOR_BLOCKS_S_FIELD_NUMBER: _ClassVar[int]
    reused_tokens: int
    pulled_blocks: int
    recomputed: bool
    transfer_bytes: int
    transfer_seconds: float
    transfer_retries: int
    prefetched_blocks: int
    waited_for_blocks_s: float
    def __init__(self, reused_tokens: _Optional[int] = ..., pulled_blocks: _Optional[int] = ..., recomputed: _Optional[bool] = ..., transfer_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., transfer_retries: _Optional[int] = ..., prefetched_blocks: _Optional[int] = ..., waited_for_blocks_s: _Optional[float] = ...) -> None: ...

class DecodePrefetch(_message.Message):
    __slots__ = ("agent_name", "reused_tokens")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    reused_tokens: int
    def __init__(self, agent_name: _Optional[str] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class DecodeSubmit(_message.Message):
    __slots__ = ("cached_prompt_tokens", "arrived_unix_s", "worker_seconds")
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    cached_prompt_tokens: int
    arrived_unix_s: float
    worker_seconds: float
    def __init__(self, cached_prompt_tokens: _Optional[int] = ..., arrived_unix_s: _Optional[float] = ..., worker_seconds: _Optional[float] = ...) -> None: ...

class TokenUpdate(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "seq", "logprobs", "top_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    seq: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TopLogprobs]
    prompt_logprobs: _inference_pb2.PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., seq: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_inference_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_inference_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class TokenUpdates(_message.Message):
    __slots__ = ("updates", "prompt_tokens_per_s")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[TokenUpdate]
    prompt_tokens_per_s: float
    def __init__(self, updates: _Optional[_Iterable[_Union[TokenUpdate, _Mapping]]] = ..., prompt_tokens_per_s: _Optional[float] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("seq", "stored", "removed", "full", "num_available", "num_blocks")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    NUM_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    full: bool
    num_available: int
    num_blocks: int
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., full: _Optional[bool] = ..., num_available: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class WorkerHealth(_message.Message):
    __slots__ = ("worker_id", "role", "engine_alive", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ALIVE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    engine_alive: bool
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., engine_alive: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class ServeInfo(_message.Message):
    __slots__ = ("model_dir", "block_size", "max_model_len", "vocab_size", "placement_policy", "load_factor", "max_local_prefill_tokens", "kv_transfer_overlap", "max_prefill_queue_tokens")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MAX_LOCAL_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    block_size: int
    max_model_len: int
    vocab_size: int
    placement_policy: str
    load_factor: float
    max_local_prefill_tokens: int
    kv_transfer_overlap: bool
    max_prefill_queue_tokens: int
    def __init__(self, model_dir: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., placement_policy: _Optional[str] = ..., load_factor: _Optional[float] = ..., max_local_prefill_tokens: _Optional[int] = ..., kv_transfer_overlap: _Optional[bool] = ..., max_prefill_queue_tokens: _Optional[int] = ...) -> None: ...
