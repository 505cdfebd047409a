from kvrs.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "lease_s", "sampling", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    sampling: _common_pb2.SamplingParams
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "prompt_tokens", "kv_bytes", "prefill_s", "queued_s", "lease_expires_unix_ms", "instance_id", "prefix_hit_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    prompt_tokens: int
    kv_bytes: int
    prefill_s: float
    queued_s: float
    lease_expires_unix_ms: int
    instance_id: str
    prefix_hit_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prefill_s: _Optional[float] = ..., queued_s: _Optional[float] = ..., lease_expires_unix_ms: _Optional[int] = ..., instance_id: _Optional[str] = ..., prefix_hit_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "generated_token_ids", "max_new_tokens", "stop_token_id", "release_when_done", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_WHEN_DONE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    stop_token_id: int
    release_when_done: bool
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_id: _Optional[int] = ..., release_when_done: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "token_id", "index", "step_s", "last")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    index: int
    step_s: float
    last: bool
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., index: _Optional[int] = ..., step_s: _Optional[float] = ..., last: _Optional[bool] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ExtendResponse(_message.Message):
    __slots__ = ("request_id", "next_token_id", "resident_tokens", "extend_s", "kv_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    next_token_id: int
    resident_tokens: int
    extend_s: float
    kv_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., next_token_id: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., extend_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("request_id", "source_instance_id", "source_address", "token_start", "token_end", "prompt_tokens", "prefix_token_ids", "lease_s", "pacing_bps", "while_prefilling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PACING_BPS_FIELD_NUMBER: _ClassVar[int]
    WHILE_PREFILLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_instance_id: str
    source_address: str
    token_start: int
    token_end: int
    prompt_tokens: int
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    pacing_bps: float
    while_prefilling: bool
    def __init__(self, request_id: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., source_address: _Optional[str] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., pacing_bps: _Optional[float] = ..., while_prefilling: _Optional[bool] = ...) -> None: ...

class PullKvResponse(_message.Message):
    __slots__ = ("request_id", "resident_tokens", "transferred_kv_bytes", "transfer_s", "transfer_bps", "recomputed_tokens", "recompute_s", "total_s", "transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BPS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    resident_tokens: int
    transferred_kv_bytes: int
    transfer_s: float
    transfer_bps: float
    recomputed_tokens: int
    recompute_s: float
    total_s: float
    transfer_id: str
    def __init__(self, request_id: _Optional[str] = ..., resident_tokens: _Optional[int] = ..., transferred_kv_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., transfer_bps: _Optional[float] = ..., recomputed_tokens: _Optional[int] = ..., recompute_s: _Optional[float] = ..., total_s: _Optional[float] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class KvTransferTicket(_message.Message):
    __slots__ = ("protocol_version", "transfer_id", "tag", "receiver_instance_id", "receiver_incarnation", "rendezvous_address", "group_generation", "sender_instance_id", "request_id", "token_start", "token_end", "traceparent", "auth_key")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SENDER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    AUTH_KEY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    transfer_id: str
    tag: int
    receiver_instance_id: str
    receiver_incarnation: str
    rendezvous_address: str
    group_generation: int
    sender_instance_id: str
    request_id: str
    token_start: int
    token_end: int
    traceparent: str
    auth_key: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., transfer_id: _Optional[str] = ..., tag: _Optional[int] = ..., receiver_instance_id: _Optional[str] = ..., receiver_incarnation: _Optional[str] = ..., rendezvous_address: _Optional[str] = ..., group_generation: _Optional[int] = ..., sender_instance_id: _Optional[str] = ..., request_id: _Optional[str] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., traceparent: _Optional[str] = ..., auth_key: _Optional[bytes] = ...) -> None: ...

class SendKvRequest(_message.Message):
    __slots__ = ("request_id", "ticket", "pacing_bps", "while_prefilling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PACING_BPS_FIELD_NUMBER: _ClassVar[int]
    WHILE_PREFILLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ticket: KvTransferTicket
    pacing_bps: float
    while_prefilling: bool
    def __init__(self, request_id: _Optional[str] = ..., ticket: _Optional[_Union[KvTransferTicket, _Mapping]] = ..., pacing_bps: _Optional[float] = ..., while_prefilling: _Optional[bool] = ...) -> None: ...

class SendKvResponse(_message.Message):
    __slots__ = ("request_id", "kv_bytes", "transfer_s", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_bytes: int
    transfer_s: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released", "freed_kv_bytes")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FREED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    released: bool
    freed_kv_bytes: int
    def __init__(self, released: _Optional[bool] = ..., freed_kv_bytes: _Optional[int] = ...) -> None: ...

class GetWorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerStatsResponse(_message.Message):
    __slots__ = ("instance_id", "role", "model", "dtype", "location", "transfer_address", "protocol_version", "resident_requests", "block_tokens", "kv_capacity_blocks", "free_kv_blocks", "used_kv_bytes", "kv_capacity_bytes", "queued_work_s", "queue_depth", "running_requests", "evicted_requests", "expired_requests", "resident_prefix_hashes", "compute_factor")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_WORK_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: _common_pb2.Role
    model: str
    dtype: str
    location: _common_pb2.Location
    transfer_address: str
    protocol_version: int
    resident_requests: int
    block_tokens: int
    kv_capacity_blocks: int
    free_kv_blocks: int
    used_kv_bytes: int
    kv_capacity_bytes: int
    queued_work_s: float
    queue_depth: int
    running_requests: int
    evicted_requests: int
    expired_requests: int
    resident_prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    compute_factor: float
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., location: _Optional[_Union[_common_pb2.Location, _Mapping]] = ..., transfer_address: _Optional[str] = ..., protocol_version: _Optional[int] = ..., resident_requests: _Optional[int] = ..., block_tokens: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., used_kv_bytes: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., queued_work_s: _Optional[float] = ..., queue_depth: _Optional[int] = ..., running_requests: _Optional[int] = ..., evicted_requests: _Optional[int] = ..., expired_requests: _Optional[int] = ..., resident_prefix_hashes: _Optional[_Iterable[int]] = ..., compute_factor: _Optional[float] = ...) -> None: ...
