from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "top_logprobs", "n", "prompt_logprobs", "structured_output")
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
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
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
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: bool
    top_logprobs: int
    n: int
    prompt_logprobs: int
    structured_output: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "ranks", "top_logprobs", "token_ids")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "messages", "sampling_params", "model", "tools")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling_params: SamplingParams
    model: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "top_logprobs", "index", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    index: int
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "vocab_size")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    vocab_size: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_in_use", "running_requests", "waiting_requests", "pinned_requests", "blocks_pulled", "blocks_reused", "bytes_pulled", "transfers", "lease_expiries", "preemptions", "checksum_failures", "handover_waits", "transfer_failures", "local_prefills", "blocks_prefetched", "prefetch_reads", "prefetch_expiries", "router_lease_expiries", "step_times", "step_seconds_bounds", "steps_launched_ahead", "loop_turns", "loop_seconds", "gc_collections", "gc_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_WAITS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_READS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_LAUNCHED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOP_TURNS_FIELD_NUMBER: _ClassVar[int]
    LOOP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GC_COLLECTIONS_FIELD_NUMBER: _ClassVar[int]
    GC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_in_use: int
    running_requests: int
    waiting_requests: int
    pinned_requests: int
    blocks_pulled: int
    blocks_reused: int
    bytes_pulled: int
    transfers: int
    lease_expiries: int
    preemptions: int
    checksum_failures: int
    handover_waits: int
    transfer_failures: int
    local_prefills: int
    blocks_prefetched: int
    prefetch_reads: int
    prefetch_expiries: int
    router_lease_expiries: int
    step_times: _containers.RepeatedCompositeFieldContainer[StepTimes]
    step_seconds_bounds: _containers.RepeatedScalarFieldContainer[float]
    steps_launched_ahead: int
    loop_turns: int
    loop_seconds: float
    gc_collections: _containers.RepeatedScalarFieldContainer[int]
    gc_seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_blocks_in_use: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., pinned_requests: _Optional[int] = ..., blocks_pulled: _Optional[int] = ..., blocks_reused: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., transfers: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., preemptions: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., handover_waits: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., local_prefills: _Optional[int] = ..., blocks_prefetched: _Optional[int] = ..., prefetch_reads: _Optional[int] = ..., prefetch_expiries: _Optional[int] = ..., router_lease_expiries: _Optional[int] = ..., step_times: _Optional[_Iterable[_Union[StepTimes, _Mapping]]] = ..., step_seconds_bounds: _Optional[_Iterable[float]] = ..., steps_launched_ahead: _Optional[int] = ..., loop_turns: _Optional[int] = ..., loop_seconds: _Optional[float] = ..., gc_collections: _Optional[_Iterable[int]] = ..., gc_seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class StepTimes(_message.Message):
    __slots__ = ("kind", "batch", "count", "sum_seconds", "sequences", "bucket_counts")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    batch: str
    count: int
    sum_seconds: float
    sequences: int
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., batch: _Optional[str] = ..., count: _Optional[int] = ..., sum_seconds: _Optional[float] = ..., sequences: _Optional[int] = ..., bucket_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class PlacementStats(_message.Message):
    __slots__ = ("pool", "placed", "inflight", "load", "prompt_tokens", "cached_tokens", "predicted_cached_tokens", "off_home", "membership_changes", "last_remap_fraction", "index_entries", "index_gaps", "hit_rate", "max_load_ratio")
    class PlacedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class InflightEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LoadEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POOL_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFF_HOME_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_CHANGES_FIELD_NUMBER: _ClassVar[int]
    LAST_REMAP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    INDEX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    INDEX_GAPS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    pool: str
    placed: _containers.ScalarMap[str, int]
    inflight: _containers.ScalarMap[str, int]
    load: _containers.ScalarMap[str, float]
    prompt_tokens: int
    cached_tokens: int
    predicted_cached_tokens: int
    off_home: int
    membership_changes: int
    last_remap_fraction: float
    index_entries: int
    index_gaps: int
    hit_rate: float
    max_load_ratio: float
    def __init__(self, pool: _Optional[str] = ..., placed: _Optional[_Mapping[str, int]] = ..., inflight: _Optional[_Mapping[str, int]] = ..., load: _Optional[_Mapping[str, float]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., predicted_cached_tokens: _Optional[int] = ..., off_home: _Optional[int] = ..., membership_changes: _Optional[int] = ..., last_remap_fraction: _Optional[float] = ..., index_entries: _Optional[int] = ..., index_gaps: _Optional[int] = ..., hit_rate: _Optional[float] = ..., max_load_ratio: _Optional[float] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("workers", "placement", "down_workers", "pools")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    DOWN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    placement: _containers.RepeatedCompositeFieldContainer[PlacementStats]
    down_workers: _containers.RepeatedScalarFieldContainer[str]
    pools: _containers.RepeatedCompositeFieldContainer[PoolWorkers]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., placement: _Optional[_Iterable[_Union[PlacementStats, _Mapping]]] = ..., down_workers: _Optional[_Iterable[str]] = ..., pools: _Optional[_Iterable[_Union[PoolWorkers, _Mapping]]] = ...) -> None: ...

class PoolWorkers(_message.Message):
    __slots__ = ("pool", "desired", "ready", "starting", "failed")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    desired: int
    ready: int
    starting: int
    failed: int
    def __init__(self, pool: _Optional[str] = ..., desired: _Optional[int] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("worker_id", "role", "drain_timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    drain_timeout_s: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class RoleChange(_message.Message):
    __slots__ = ("worker_id", "from_role", "to_role", "ok", "error", "drain_s", "switch_s", "probe_s", "epoch", "streams_moved", "started_at")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    PROBE_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STREAMS_MOVED_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    from_role: str
    to_role: str
    ok: bool
    error: str
    drain_s: float
    switch_s: float
    probe_s: float
    epoch: int
    streams_moved: int
    started_at: float
    def __init__(self, worker_id: _Optional[str] = ..., from_role: _Optional[str] = ..., to_role: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., drain_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., probe_s: _Optional[float] = ..., epoch: _Optional[int] = ..., streams_moved: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("change",)
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    change: RoleChange
    def __init__(self, change: _Optional[_Union[RoleChange, _Mapping]] = ...) -> None: ...

class GetControllerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControllerDecision(_message.Message):
    __slots__ = ("t", "action", "reason", "prefill", "decode", "target_prefill", "target_decode", "flip_from", "count", "load_prefill", "load_decode", "pool")
    T_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TARGET_DECODE_FIELD_NUMBER: _ClassVar[int]
    FLIP_FROM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LOAD_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOAD_DECODE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    t: float
    action: str
    reason: str
    prefill: int
    decode: int
    target_prefill: int
    target_decode: int
    flip_from: str
    count: int
    load_prefill: float
    load_decode: float
    pool: str
    def __init__(self, t: _Optional[float] = ..., action: _Optional[str] = ..., reason: _Optional[str] = ..., prefill: _Optional[int] = ..., decode: _Optional[int] = ..., target_prefill: _Optional[int] = ..., target_decode: _Optional[int] = ..., flip_from: _Optional[str] = ..., count: _Optional[int] = ..., load_prefill: _Optional[float] = ..., load_decode: _Optional[float] = ..., pool: _Optional[str] = ...) -> None: ...

class ControllerState(_message.Message):
    __slots__ = ("enabled", "prefill", "decode", "target_prefill", "target_decode", "interval_s", "flip_s", "decisions", "changes", "unhealthy", "max_workers", "workers_held", "start_s", "flips_refused")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TARGET_DECODE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    FLIP_S_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_HELD_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    FLIPS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    prefill: int
    decode: int
    target_prefill: int
    target_decode: int
    interval_s: float
    flip_s: float
    decisions: _containers.RepeatedCompositeFieldContainer[ControllerDecision]
    changes: _containers.RepeatedCompositeFieldContainer[RoleChange]
    unhealthy: _containers.RepeatedScalarFieldContainer[str]
    max_workers: int
    workers_held: int
    start_s: float
    flips_refused: str
    def __init__(self, enabled: _Optional[bool] = ..., prefill: _Optional[int] = ..., decode: _Optional[int] = ..., target_prefill: _Optional[int] = ..., target_decode: _Optional[int] = ..., interval_s: _Optional[float] = ..., flip_s: _Optional[float] = ..., decisions: _Optional[_Iterable[_Union[ControllerDecision, _Mapping]]] = ..., changes: _Optional[_Iterable[_Union[RoleChange, _Mapping]]] = ..., unhealthy: _Optional[_Iterable[str]] = ..., max_workers: _Optional[int] = ..., workers_held: _Optional[int] = ..., start_s: _Optional[float] = ..., flips_refused: _Optional[str] = ...) -> None: ...
