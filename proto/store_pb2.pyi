from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Label(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class SegmentHeader(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "context_key", "parent_key", "content_key", "token_ids", "start_position", "layer_start", "layer_end", "boundary_layers", "payload_nbytes", "checksum", "ttl_s", "left_tail_ids", "index_text", "created_at_s", "labels", "kind", "exact", "engine_block_hashes", "engine_parent_block_hash", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    CONTENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEFT_TAIL_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_TEXT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_S_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: str
    context_key: bytes
    parent_key: bytes
    content_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    layer_start: int
    layer_end: int
    boundary_layers: _containers.RepeatedScalarFieldContainer[int]
    payload_nbytes: int
    checksum: int
    ttl_s: float
    left_tail_ids: _containers.RepeatedScalarFieldContainer[int]
    index_text: str
    created_at_s: float
    labels: _containers.RepeatedCompositeFieldContainer[Label]
    kind: str
    exact: bool
    engine_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    engine_parent_block_hash: bytes
    session_id: str
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., context_key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., content_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., boundary_layers: _Optional[_Iterable[int]] = ..., payload_nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., ttl_s: _Optional[float] = ..., left_tail_ids: _Optional[_Iterable[int]] = ..., index_text: _Optional[str] = ..., created_at_s: _Optional[float] = ..., labels: _Optional[_Iterable[_Union[Label, _Mapping]]] = ..., kind: _Optional[str] = ..., exact: _Optional[bool] = ..., engine_block_hashes: _Optional[_Iterable[bytes]] = ..., engine_parent_block_hash: _Optional[bytes] = ..., session_id: _Optional[str] = ...) -> None: ...

class PutSegmentRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SegmentHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[SegmentHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class StagedPayload(_message.Message):
    __slots__ = ("name", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class PutStagedSegmentRequest(_message.Message):
    __slots__ = ("header", "staged")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    header: SegmentHeader
    staged: StagedPayload
    def __init__(self, header: _Optional[_Union[SegmentHeader, _Mapping]] = ..., staged: _Optional[_Union[StagedPayload, _Mapping]] = ...) -> None: ...

class PutSegmentResponse(_message.Message):
    __slots__ = ("context_key",)
    CONTEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    context_key: bytes
    def __init__(self, context_key: _Optional[bytes] = ...) -> None: ...

class GetSegmentRequest(_message.Message):
    __slots__ = ("namespace", "context_key", "model_fingerprint")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    context_key: bytes
    model_fingerprint: str
    def __init__(self, namespace: _Optional[str] = ..., context_key: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class GetSegmentResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SegmentHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[SegmentHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class SegmentRef(_message.Message):
    __slots__ = ("context_key", "start_position", "num_tokens", "layer_start", "layer_end", "payload_nbytes")
    CONTEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_NBYTES_FIELD_NUMBER: _ClassVar[int]
    context_key: bytes
    start_position: int
    num_tokens: int
    layer_start: int
    layer_end: int
    payload_nbytes: int
    def __init__(self, context_key: _Optional[bytes] = ..., start_position: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., payload_nbytes: _Optional[int] = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "token_ids", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: str
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[str] = ...) -> None: ...

class LookupPrefixResponse(_message.Message):
    __slots__ = ("segments", "num_matched_tokens")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentRef]
    num_matched_tokens: int
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentRef, _Mapping]]] = ..., num_matched_tokens: _Optional[int] = ...) -> None: ...

class FindSimilarRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "token_ids", "text", "left_context_ids", "parent_key", "limit", "with_token_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LEFT_CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    WITH_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    left_context_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_key: bytes
    limit: int
    with_token_ids: bool
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., left_context_ids: _Optional[_Iterable[int]] = ..., parent_key: _Optional[bytes] = ..., limit: _Optional[int] = ..., with_token_ids: _Optional[bool] = ...) -> None: ...

class SimilarCandidate(_message.Message):
    __slots__ = ("segment", "estimated_jaccard", "exact_tokens", "same_left_context", "exact_window", "token_ids", "exact")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_JACCARD_FIELD_NUMBER: _ClassVar[int]
    EXACT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAME_LEFT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EXACT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    segment: SegmentRef
    estimated_jaccard: float
    exact_tokens: bool
    same_left_context: bool
    exact_window: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    exact: bool
    def __init__(self, segment: _Optional[_Union[SegmentRef, _Mapping]] = ..., estimated_jaccard: _Optional[float] = ..., exact_tokens: _Optional[bool] = ..., same_left_context: _Optional[bool] = ..., exact_window: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., exact: _Optional[bool] = ...) -> None: ...

class FindSimilarResponse(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[SimilarCandidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[SimilarCandidate, _Mapping]]] = ...) -> None: ...

class PutAnchorRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "placeholder_id", "anchor_id", "base_payload", "agent_payloads", "num_tokens", "chunk")
    class AgentPayloadsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    AGENT_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: str
    placeholder_id: str
    anchor_id: str
    base_payload: bytes
    agent_payloads: _containers.ScalarMap[str, bytes]
    num_tokens: int
    chunk: AnchorChunk
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., placeholder_id: _Optional[str] = ..., anchor_id: _Optional[str] = ..., base_payload: _Optional[bytes] = ..., agent_payloads: _Optional[_Mapping[str, bytes]] = ..., num_tokens: _Optional[int] = ..., chunk: _Optional[_Union[AnchorChunk, _Mapping]] = ...) -> None: ...

class AnchorChunk(_message.Message):
    __slots__ = ("anchor_id", "agent_id", "data")
    ANCHOR_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    anchor_id: str
    agent_id: str
    data: bytes
    def __init__(self, anchor_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutAnchorResponse(_message.Message):
    __slots__ = ("evicted_anchor_ids",)
    EVICTED_ANCHOR_IDS_FIELD_NUMBER: _ClassVar[int]
    evicted_anchor_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, evicted_anchor_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetAnchorsRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "placeholder_id", "include_payloads", "anchor_ids", "agent_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_IDS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: str
    placeholder_id: str
    include_payloads: bool
    anchor_ids: _containers.RepeatedScalarFieldContainer[str]
    agent_id: str
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., placeholder_id: _Optional[str] = ..., include_payloads: _Optional[bool] = ..., anchor_ids: _Optional[_Iterable[str]] = ..., agent_id: _Optional[str] = ...) -> None: ...

class AnchorEntry(_message.Message):
    __slots__ = ("anchor_id", "num_tokens", "activation_count", "created_seq", "base_payload", "agent_payloads", "agent_ids")
    class AgentPayloadsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    ANCHOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    AGENT_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    anchor_id: str
    num_tokens: int
    activation_count: int
    created_seq: int
    base_payload: bytes
    agent_payloads: _containers.ScalarMap[str, bytes]
    agent_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, anchor_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., activation_count: _Optional[int] = ..., created_seq: _Optional[int] = ..., base_payload: _Optional[bytes] = ..., agent_payloads: _Optional[_Mapping[str, bytes]] = ..., agent_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetAnchorsResponse(_message.Message):
    __slots__ = ("anchors", "chunk")
    ANCHORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    anchors: _containers.RepeatedCompositeFieldContainer[AnchorEntry]
    chunk: AnchorChunk
    def __init__(self, anchors: _Optional[_Iterable[_Union[AnchorEntry, _Mapping]]] = ..., chunk: _Optional[_Union[AnchorChunk, _Mapping]] = ...) -> None: ...

class TouchAnchorsRequest(_message.Message):
    __slots__ = ("namespace", "model_fingerprint", "placeholder_id", "anchor_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_fingerprint: str
    placeholder_id: str
    anchor_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., placeholder_id: _Optional[str] = ..., anchor_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TouchAnchorsResponse(_message.Message):
    __slots__ = ("num_touched",)
    NUM_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    num_touched: int
    def __init__(self, num_touched: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "context_key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    context_key: bytes
    def __init__(self, namespace: _Optional[str] = ..., context_key: _Optional[bytes] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_segments", "num_bytes", "num_hits", "num_misses", "num_evictions", "num_refused_puts", "num_calls", "num_prompt_tokens", "num_local_hit_tokens", "num_in_place_hit_tokens", "num_grpc_hit_tokens", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_PUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CALLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_PLACE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GRPC_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    num_segments: int
    num_bytes: int
    num_hits: int
    num_misses: int
    num_evictions: int
    num_refused_puts: int
    num_calls: int
    num_prompt_tokens: int
    num_local_hit_tokens: int
    num_in_place_hit_tokens: int
    num_grpc_hit_tokens: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, num_segments: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_refused_puts: _Optional[int] = ..., num_calls: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_local_hit_tokens: _Optional[int] = ..., num_in_place_hit_tokens: _Optional[int] = ..., num_grpc_hit_tokens: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DescribeDataPlaneRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class DescribeDataPlaneResponse(_message.Message):
    __slots__ = ("host_id", "lmdb_path", "lmdb_device", "lmdb_inode", "server_pid", "staging_dir")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LMDB_PATH_FIELD_NUMBER: _ClassVar[int]
    LMDB_DEVICE_FIELD_NUMBER: _ClassVar[int]
    LMDB_INODE_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    STAGING_DIR_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    lmdb_path: str
    lmdb_device: int
    lmdb_inode: int
    server_pid: int
    staging_dir: str
    def __init__(self, host_id: _Optional[str] = ..., lmdb_path: _Optional[str] = ..., lmdb_device: _Optional[int] = ..., lmdb_inode: _Optional[int] = ..., server_pid: _Optional[int] = ..., staging_dir: _Optional[str] = ...) -> None: ...

class SegmentReads(_message.Message):
    __slots__ = ("context_key", "served", "num_reads")
    CONTEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_READS_FIELD_NUMBER: _ClassVar[int]
    context_key: bytes
    served: str
    num_reads: int
    def __init__(self, context_key: _Optional[bytes] = ..., served: _Optional[str] = ..., num_reads: _Optional[int] = ...) -> None: ...

class ReportReuseRequest(_message.Message):
    __slots__ = ("namespace", "num_calls", "num_prompt_tokens", "num_local_hit_tokens", "num_in_place_hit_tokens", "num_grpc_hit_tokens", "reads", "num_approximate_hit_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_CALLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_PLACE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GRPC_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    NUM_APPROXIMATE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    num_calls: int
    num_prompt_tokens: int
    num_local_hit_tokens: int
    num_in_place_hit_tokens: int
    num_grpc_hit_tokens: int
    reads: _containers.RepeatedCompositeFieldContainer[SegmentReads]
    num_approximate_hit_tokens: int
    def __init__(self, namespace: _Optional[str] = ..., num_calls: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_local_hit_tokens: _Optional[int] = ..., num_in_place_hit_tokens: _Optional[int] = ..., num_grpc_hit_tokens: _Optional[int] = ..., reads: _Optional[_Iterable[_Union[SegmentReads, _Mapping]]] = ..., num_approximate_hit_tokens: _Optional[int] = ...) -> None: ...

class ReportReuseResponse(_message.Message):
    __slots__ = ("num_reads_counted",)
    NUM_READS_COUNTED_FIELD_NUMBER: _ClassVar[int]
    num_reads_counted: int
    def __init__(self, num_reads_counted: _Optional[int] = ...) -> None: ...

class SessionRenewRequest(_message.Message):
    __slots__ = ("namespace", "session_id", "lease_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    lease_s: float
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., lease_s: _Optional[float] = ...) -> None: ...

class SessionRenewResponse(_message.Message):
    __slots__ = ("outcome", "lease_s", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    lease_s: float
    reason: str
    def __init__(self, outcome: _Optional[str] = ..., lease_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class SessionEndRequest(_message.Message):
    __slots__ = ("namespace", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class SessionEndResponse(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    def __init__(self, ended: _Optional[bool] = ...) -> None: ...
