from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "chunk_tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("name", "salt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    name: str
    salt: bytes
    def __init__(self, name: _Optional[str] = ..., salt: _Optional[bytes] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_id", "address", "data_address", "attention_kernel")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_KERNEL_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    address: str
    data_address: str
    attention_kernel: str
    def __init__(self, shard_id: _Optional[str] = ..., address: _Optional[str] = ..., data_address: _Optional[str] = ..., attention_kernel: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("tenant", "namespaces", "shards", "replication", "max_message_bytes", "weight", "admin")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    replication: int
    max_message_bytes: int
    weight: float
    admin: bool
    def __init__(self, tenant: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., replication: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., weight: _Optional[float] = ..., admin: bool = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "layout", "token_ids", "chunk_indices")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDICES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KVLayout
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    chunk_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., chunk_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("chunk_keys", "present", "partial_index", "partial_tokens", "partial_key", "cached_tokens", "proofs", "partial_proof")
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROOFS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_PROOF_FIELD_NUMBER: _ClassVar[int]
    chunk_keys: _containers.RepeatedScalarFieldContainer[int]
    present: _containers.RepeatedScalarFieldContainer[int]
    partial_index: int
    partial_tokens: int
    partial_key: int
    cached_tokens: int
    proofs: _containers.RepeatedCompositeFieldContainer[ChunkProof]
    partial_proof: ChunkProof
    def __init__(self, chunk_keys: _Optional[_Iterable[int]] = ..., present: _Optional[_Iterable[int]] = ..., partial_index: _Optional[int] = ..., partial_tokens: _Optional[int] = ..., partial_key: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., proofs: _Optional[_Iterable[_Union[ChunkProof, _Mapping]]] = ..., partial_proof: _Optional[_Union[ChunkProof, _Mapping]] = ...) -> None: ...

class ChunkProof(_message.Message):
    __slots__ = ("digest", "signature")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    signature: bytes
    def __init__(self, digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ChunkRef(_message.Message):
    __slots__ = ("key", "tokens", "digest")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    key: int
    tokens: int
    digest: bytes
    def __init__(self, key: _Optional[int] = ..., tokens: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("layer", "chunk", "data", "crc32c")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    layer: int
    chunk: int
    data: bytes
    crc32c: int
    def __init__(self, layer: _Optional[int] = ..., chunk: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "segments", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    segments: SegmentBatch
    commit: PutCommit
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., segments: _Optional[_Union[SegmentBatch, _Mapping]] = ..., commit: _Optional[_Union[PutCommit, _Mapping]] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace", "layout", "token_ids", "chunk_indices", "signatures")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDICES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KVLayout
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    chunk_indices: _containers.RepeatedScalarFieldContainer[int]
    signatures: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., chunk_indices: _Optional[_Iterable[int]] = ..., signatures: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SegmentBatch(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class PutCommit(_message.Message):
    __slots__ = ("crc32c",)
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("chunk_keys", "stored_bytes", "new_keys")
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEW_KEYS_FIELD_NUMBER: _ClassVar[int]
    chunk_keys: _containers.RepeatedScalarFieldContainer[int]
    stored_bytes: int
    new_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunk_keys: _Optional[_Iterable[int]] = ..., stored_bytes: _Optional[int] = ..., new_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("namespace", "layout", "chunks", "layer_start", "layer_end", "max_message_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KVLayout
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    layer_start: int
    layer_end: int
    max_message_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("ticket", "data_address", "total_bytes", "expires_ms", "signature")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_address: str
    total_bytes: int
    expires_ms: int
    signature: bytes
    def __init__(self, ticket: _Optional[bytes] = ..., data_address: _Optional[str] = ..., total_bytes: _Optional[int] = ..., expires_ms: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ArtifactId(_message.Message):
    __slots__ = ("namespace", "layout", "prefix_key", "prefix_tokens", "compressor", "signature", "size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KVLayout
    prefix_key: int
    prefix_tokens: int
    compressor: str
    signature: bytes
    size: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., prefix_key: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., compressor: _Optional[str] = ..., signature: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class PutArtifactRequest(_message.Message):
    __slots__ = ("id", "data", "crc32c")
    ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    id: ArtifactId
    data: bytes
    crc32c: int
    def __init__(self, id: _Optional[_Union[ArtifactId, _Mapping]] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class FetchArtifactRequest(_message.Message):
    __slots__ = ("id", "max_message_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: ArtifactId
    max_message_bytes: int
    def __init__(self, id: _Optional[_Union[ArtifactId, _Mapping]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class FetchArtifactResponse(_message.Message):
    __slots__ = ("data", "crc32c", "total_bytes", "signature")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    crc32c: int
    total_bytes: int
    signature: bytes
    def __init__(self, data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., total_bytes: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "layout", "token_ids", "chunk_keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KVLayout
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    chunk_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., chunk_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("chunks", "artifacts", "bytes")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    artifacts: int
    bytes: int
    def __init__(self, chunks: _Optional[int] = ..., artifacts: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("header", "query")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    header: AttendHeader
    query: AttendQuery
    def __init__(self, header: _Optional[_Union[AttendHeader, _Mapping]] = ..., query: _Optional[_Union[AttendQuery, _Mapping]] = ...) -> None: ...

class AttendHeader(_message.Message):
    __slots__ = ("namespace", "layout", "chunks", "kernel", "heads")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: KVLayout
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    kernel: str
    heads: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ..., kernel: _Optional[str] = ..., heads: _Optional[int] = ...) -> None: ...

class AttendQuery(_message.Message):
    __slots__ = ("layer", "rows", "q")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    layer: int
    rows: int
    q: bytes
    def __init__(self, layer: _Optional[int] = ..., rows: _Optional[int] = ..., q: _Optional[bytes] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("layer", "m", "l", "acc", "crc32c", "compute_s")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    L_FIELD_NUMBER: _ClassVar[int]
    ACC_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    layer: int
    m: bytes
    l: bytes
    acc: bytes
    crc32c: int
    compute_s: float
    def __init__(self, layer: _Optional[int] = ..., m: _Optional[bytes] = ..., l: _Optional[bytes] = ..., acc: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., compute_s: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("shard_id", "memory_bytes", "memory_capacity", "disk_bytes", "disk_capacity", "chunks", "artifacts", "tenant_bytes", "lookup_hits", "lookup_misses", "fetched_bytes", "evictions", "leased_chunks")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISSES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    memory_bytes: int
    memory_capacity: int
    disk_bytes: int
    disk_capacity: int
    chunks: int
    artifacts: int
    tenant_bytes: int
    lookup_hits: int
    lookup_misses: int
    fetched_bytes: int
    evictions: int
    leased_chunks: int
    def __init__(self, shard_id: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., memory_capacity: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_capacity: _Optional[int] = ..., chunks: _Optional[int] = ..., artifacts: _Optional[int] = ..., tenant_bytes: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., lookup_misses: _Optional[int] = ..., fetched_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., leased_chunks: _Optional[int] = ...) -> None: ...
