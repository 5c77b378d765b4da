from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_MAX_CONTEXT: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_MAX_CONTEXT: FinishReason
FINISH_REASON_ABORT: FinishReason

class Partition(_message.Message):
    __slots__ = ("cache_salt", "extra_key")
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    cache_salt: str
    extra_key: str
    def __init__(self, cache_salt: _Optional[str] = ..., extra_key: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_text", "sampling", "partition", "priority", "routing_key", "prompt_text_suffix", "prompt_text_is_chat", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_SUFFIX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_IS_CHAT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: TokenIds
    prompt_text: str
    sampling: SamplingParams
    partition: Partition
    priority: int
    routing_key: str
    prompt_text_suffix: str
    prompt_text_is_chat: bool
    model: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., prompt_text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ..., priority: _Optional[int] = ..., routing_key: _Optional[str] = ..., prompt_text_suffix: _Optional[str] = ..., prompt_text_is_chat: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage", "worker_id", "attempts")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    worker_id: str
    attempts: int
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., worker_id: _Optional[str] = ..., attempts: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "has_parent", "parent_hash", "token_ids", "partition")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    block_hashes: bytes
    has_parent: bool
    parent_hash: int
    token_ids: bytes
    partition: Partition
    def __init__(self, block_hashes: _Optional[bytes] = ..., has_parent: _Optional[bool] = ..., parent_hash: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: bytes
    def __init__(self, block_hashes: _Optional[bytes] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllCleared, _Mapping]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_queued_prefill_tokens", "num_free_kv_tokens", "num_evictable_kv_tokens", "num_total_kv_tokens")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTABLE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    num_free_kv_tokens: int
    num_evictable_kv_tokens: int
    num_total_kv_tokens: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., num_free_kv_tokens: _Optional[int] = ..., num_evictable_kv_tokens: _Optional[int] = ..., num_total_kv_tokens: _Optional[int] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "block_size", "events", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    seq: int
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    load: LoadReport
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "block_size", "blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    seq: int
    block_size: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockStored]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., block_size: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockStored, _Mapping]]] = ...) -> None: ...

class EventBatchRun(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[EventBatch]
    def __init__(self, batches: _Optional[_Iterable[_Union[EventBatch, _Mapping]]] = ...) -> None: ...

class KvStreamMessage(_message.Message):
    __slots__ = ("batch", "snapshot", "run")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    batch: EventBatch
    snapshot: Snapshot
    run: EventBatchRun
    def __init__(self, batch: _Optional[_Union[EventBatch, _Mapping]] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., run: _Optional[_Union[EventBatchRun, _Mapping]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("epoch", "after_seq", "subscriber_id", "accepts_runs")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_RUNS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    after_seq: int
    subscriber_id: str
    accepts_runs: bool
    def __init__(self, epoch: _Optional[int] = ..., after_seq: _Optional[int] = ..., subscriber_id: _Optional[str] = ..., accepts_runs: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "epoch", "block_size", "page_size", "kv_capacity_tokens", "max_context_tokens", "vocab_size", "executor", "load", "model_name", "tokenizer_fingerprint", "hash_key_fingerprint", "max_running_requests", "step_decode_base_s", "step_decode_s_per_seq", "step_decode_s_per_context_token", "step_prefill_s_per_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HASH_KEY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEP_DECODE_BASE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_DECODE_S_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_DECODE_S_PER_CONTEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    block_size: int
    page_size: int
    kv_capacity_tokens: int
    max_context_tokens: int
    vocab_size: int
    executor: str
    load: LoadReport
    model_name: str
    tokenizer_fingerprint: str
    hash_key_fingerprint: str
    max_running_requests: int
    step_decode_base_s: float
    step_decode_s_per_seq: float
    step_decode_s_per_context_token: float
    step_prefill_s_per_token: float
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., block_size: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., executor: _Optional[str] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., model_name: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., hash_key_fingerprint: _Optional[str] = ..., max_running_requests: _Optional[int] = ..., step_decode_base_s: _Optional[float] = ..., step_decode_s_per_seq: _Optional[float] = ..., step_decode_s_per_context_token: _Optional[float] = ..., step_prefill_s_per_token: _Optional[float] = ...) -> None: ...

class WorkerScore(_message.Message):
    __slots__ = ("worker_id", "address", "healthy", "matched_tokens", "inflight_prefill_tokens", "cost", "load", "recent_prefill_tokens", "event_matched_tokens", "predicted_matched_tokens", "not_candidate_reason", "slot_queue", "model")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RECENT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENT_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOT_CANDIDATE_REASON_FIELD_NUMBER: _ClassVar[int]
    SLOT_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    healthy: bool
    matched_tokens: int
    inflight_prefill_tokens: int
    cost: float
    load: LoadReport
    recent_prefill_tokens: float
    event_matched_tokens: int
    predicted_matched_tokens: int
    not_candidate_reason: str
    slot_queue: int
    model: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., matched_tokens: _Optional[int] = ..., inflight_prefill_tokens: _Optional[int] = ..., cost: _Optional[float] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., recent_prefill_tokens: _Optional[float] = ..., event_matched_tokens: _Optional[int] = ..., predicted_matched_tokens: _Optional[int] = ..., not_candidate_reason: _Optional[str] = ..., slot_queue: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("policy", "prompt_tokens", "chosen_worker_id", "workers", "miss_factor", "model", "models")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MISS_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    prompt_tokens: int
    chosen_worker_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerScore]
    miss_factor: float
    model: str
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., chosen_worker_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerScore, _Mapping]]] = ..., miss_factor: _Optional[float] = ..., model: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaRouted(_message.Message):
    __slots__ = ("request_id", "worker_id", "prompt_tokens", "matched_tokens", "block_hashes", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    prompt_tokens: int
    matched_tokens: int
    block_hashes: bytes
    model: str
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., block_hashes: _Optional[bytes] = ..., model: _Optional[str] = ...) -> None: ...

class ReplicaFirstToken(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReplicaFinished(_message.Message):
    __slots__ = ("request_id", "generated_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class ReplicaEvent(_message.Message):
    __slots__ = ("routed", "first_token", "finished")
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    routed: ReplicaRouted
    first_token: ReplicaFirstToken
    finished: ReplicaFinished
    def __init__(self, routed: _Optional[_Union[ReplicaRouted, _Mapping]] = ..., first_token: _Optional[_Union[ReplicaFirstToken, _Mapping]] = ..., finished: _Optional[_Union[ReplicaFinished, _Mapping]] = ...) -> None: ...

class ReplicaBatch(_message.Message):
    __slots__ = ("router_id", "seq", "events", "leaving")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[ReplicaEvent]
    leaving: bool
    def __init__(self, router_id: _Optional[str] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[ReplicaEvent, _Mapping]]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class RelayRequest(_message.Message):
    __slots__ = ("stream_id", "starts", "cancels")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    starts: _containers.RepeatedCompositeFieldContainer[RelayStart]
    cancels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stream_id: _Optional[str] = ..., starts: _Optional[_Iterable[_Union[RelayStart, _Mapping]]] = ..., cancels: _Optional[_Iterable[str]] = ...) -> None: ...

class RelayStart(_message.Message):
    __slots__ = ("request", "timeout_s", "metadata")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    timeout_s: float
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("responses", "accepts_starts", "ends", "cancelled")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_STARTS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    accepts_starts: bool
    ends: _containers.RepeatedCompositeFieldContainer[RelayEnd]
    cancelled: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., accepts_starts: _Optional[bool] = ..., ends: _Optional[_Iterable[_Union[RelayEnd, _Mapping]]] = ..., cancelled: _Optional[_Iterable[str]] = ...) -> None: ...

class RelayEnd(_message.Message):
    __slots__ = ("request_id", "code", "details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    details: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...
