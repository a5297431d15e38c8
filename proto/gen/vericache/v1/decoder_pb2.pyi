from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "max_new_tokens", "sampling", "mode", "compressor", "horizon", "namespace", "use_unsigned_prefix", "ngram", "stop", "stop_token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    USE_UNSIGNED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: bool
    max_new_tokens: int
    sampling: Sampling
    mode: str
    compressor: str
    horizon: int
    namespace: str
    use_unsigned_prefix: bool
    ngram: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: bool = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., mode: _Optional[str] = ..., compressor: _Optional[str] = ..., horizon: _Optional[int] = ..., namespace: _Optional[str] = ..., use_unsigned_prefix: bool = ..., ngram: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("tokens", "done")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    tokens: Tokens
    done: Done
    def __init__(self, tokens: _Optional[_Union[Tokens, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "text")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("stop_reason", "stats_json")
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    stop_reason: str
    stats_json: str
    def __init__(self, stop_reason: _Optional[str] = ..., stats_json: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "namespace", "compressors")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSORS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: bool
    namespace: str
    compressors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: bool = ..., namespace: _Optional[str] = ..., compressors: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("tokens", "stored_bytes", "artifacts", "prefill_s")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    stored_bytes: int
    artifacts: _containers.RepeatedScalarFieldContainer[str]
    prefill_s: float
    def __init__(self, tokens: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., artifacts: _Optional[_Iterable[str]] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "worker_id", "kv_budget", "kv_used", "in_flight", "queued", "default_compressor", "kv_cached", "cached_prefixes", "engines", "weight_bytes", "peak_rss_bytes", "max_new_tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_FIELD_NUMBER: _ClassVar[int]
    KV_USED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    worker_id: str
    kv_budget: int
    kv_used: int
    in_flight: int
    queued: int
    default_compressor: str
    kv_cached: int
    cached_prefixes: int
    engines: int
    weight_bytes: int
    peak_rss_bytes: int
    max_new_tokens: int
    def __init__(self, model_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., kv_budget: _Optional[int] = ..., kv_used: _Optional[int] = ..., in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., default_compressor: _Optional[str] = ..., kv_cached: _Optional[int] = ..., cached_prefixes: _Optional[int] = ..., engines: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...
