from kvrs.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ALIVE: _ClassVar[NodeState]
    NODE_STATE_FAILED: _ClassVar[NodeState]
    NODE_STATE_LEFT: _ClassVar[NodeState]
    NODE_STATE_SUSPECT: _ClassVar[NodeState]

class NodeEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_EVENT_TYPE_UNSPECIFIED: _ClassVar[NodeEventType]
    NODE_EVENT_TYPE_JOINED: _ClassVar[NodeEventType]
    NODE_EVENT_TYPE_FAILED: _ClassVar[NodeEventType]
    NODE_EVENT_TYPE_LEFT: _ClassVar[NodeEventType]
    NODE_EVENT_TYPE_SUSPECT: _ClassVar[NodeEventType]
    NODE_EVENT_TYPE_REFUTED: _ClassVar[NodeEventType]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ALIVE: NodeState
NODE_STATE_FAILED: NodeState
NODE_STATE_LEFT: NodeState
NODE_STATE_SUSPECT: NodeState
NODE_EVENT_TYPE_UNSPECIFIED: NodeEventType
NODE_EVENT_TYPE_JOINED: NodeEventType
NODE_EVENT_TYPE_FAILED: NodeEventType
NODE_EVENT_TYPE_LEFT: NodeEventType
NODE_EVENT_TYPE_SUSPECT: NodeEventType
NODE_EVENT_TYPE_REFUTED: NodeEventType

class RegisterNodeRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "role", "address", "location", "model", "kv_capacity_blocks", "transfer_address", "heartbeat_ttl_s", "max_batch_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    role: _common_pb2.Role
    address: str
    location: _common_pb2.Location
    model: str
    kv_capacity_blocks: int
    transfer_address: str
    heartbeat_ttl_s: float
    max_batch_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., location: _Optional[_Union[_common_pb2.Location, _Mapping]] = ..., model: _Optional[str] = ..., kv_capacity_blocks: _Optional[int] = ..., transfer_address: _Optional[str] = ..., heartbeat_ttl_s: _Optional[float] = ..., max_batch_tokens: _Optional[int] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "queue_depth", "queued_work_s", "running_requests", "free_kv_blocks", "resident_prefix_hashes", "load_unchanged", "prefix_hashes_unchanged", "compute_factor", "running_context_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_WORK_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    LOAD_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    RUNNING_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    queue_depth: int
    queued_work_s: float
    running_requests: int
    free_kv_blocks: int
    resident_prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    load_unchanged: bool
    prefix_hashes_unchanged: bool
    compute_factor: float
    running_context_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., queue_depth: _Optional[int] = ..., queued_work_s: _Optional[float] = ..., running_requests: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., resident_prefix_hashes: _Optional[_Iterable[int]] = ..., load_unchanged: _Optional[bool] = ..., prefix_hashes_unchanged: _Optional[bool] = ..., compute_factor: _Optional[float] = ..., running_context_tokens: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("expires_unix_ms",)
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    expires_unix_ms: int
    def __init__(self, expires_unix_ms: _Optional[int] = ...) -> None: ...

class StreamHeartbeatsResponse(_message.Message):
    __slots__ = ("instance_id", "expires_unix_ms", "code", "message")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    expires_unix_ms: int
    code: int
    message: str
    def __init__(self, instance_id: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DeregisterNodeRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterNodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("instance_id", "role", "address", "location", "model", "kv_capacity_blocks", "transfer_address", "state", "queue_depth", "queued_work_s", "running_requests", "free_kv_blocks", "resident_prefix_hashes", "age_s", "last_seen_unix_ms", "heartbeat_ttl_s", "compute_factor", "max_batch_tokens", "running_context_tokens")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_WORK_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: _common_pb2.Role
    address: str
    location: _common_pb2.Location
    model: str
    kv_capacity_blocks: int
    transfer_address: str
    state: NodeState
    queue_depth: int
    queued_work_s: float
    running_requests: int
    free_kv_blocks: int
    resident_prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    age_s: float
    last_seen_unix_ms: int
    heartbeat_ttl_s: float
    compute_factor: float
    max_batch_tokens: int
    running_context_tokens: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., location: _Optional[_Union[_common_pb2.Location, _Mapping]] = ..., model: _Optional[str] = ..., kv_capacity_blocks: _Optional[int] = ..., transfer_address: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., queue_depth: _Optional[int] = ..., queued_work_s: _Optional[float] = ..., running_requests: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., resident_prefix_hashes: _Optional[_Iterable[int]] = ..., age_s: _Optional[float] = ..., last_seen_unix_ms: _Optional[int] = ..., heartbeat_ttl_s: _Optional[float] = ..., compute_factor: _Optional[float] = ..., max_batch_tokens: _Optional[int] = ..., running_context_tokens: _Optional[int] = ...) -> None: ...

class ReportLinkSampleRequest(_message.Message):
    __slots__ = ("request_id", "src_instance_id", "dst_instance_id", "bandwidth_bps", "sample_bandwidth_bps", "rtt_s", "probe_bytes", "samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    src_instance_id: str
    dst_instance_id: str
    bandwidth_bps: float
    sample_bandwidth_bps: float
    rtt_s: float
    probe_bytes: int
    samples: int
    def __init__(self, request_id: _Optional[str] = ..., src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., bandwidth_bps: _Optional[float] = ..., sample_bandwidth_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ..., probe_bytes: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class ReportLinkSampleResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkInfo(_message.Message):
    __slots__ = ("src_instance_id", "dst_instance_id", "bandwidth_bps", "sample_bandwidth_bps", "rtt_s", "samples", "age_s", "measured_unix_ms")
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    src_instance_id: str
    dst_instance_id: str
    bandwidth_bps: float
    sample_bandwidth_bps: float
    rtt_s: float
    samples: int
    age_s: float
    measured_unix_ms: int
    def __init__(self, src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., bandwidth_bps: _Optional[float] = ..., sample_bandwidth_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ..., samples: _Optional[int] = ..., age_s: _Optional[float] = ..., measured_unix_ms: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("role", "include_down")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DOWN_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    include_down: bool
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., include_down: _Optional[bool] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "server_unix_ms")
    NODES_FIELD_NUMBER: _ClassVar[int]
    SERVER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    server_unix_ms: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., server_unix_ms: _Optional[int] = ...) -> None: ...

class ListLinksRequest(_message.Message):
    __slots__ = ("measured_after_unix_ms",)
    MEASURED_AFTER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    measured_after_unix_ms: int
    def __init__(self, measured_after_unix_ms: _Optional[int] = ...) -> None: ...

class ListLinksResponse(_message.Message):
    __slots__ = ("links", "server_unix_ms")
    LINKS_FIELD_NUMBER: _ClassVar[int]
    SERVER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkInfo]
    server_unix_ms: int
    def __init__(self, links: _Optional[_Iterable[_Union[LinkInfo, _Mapping]]] = ..., server_unix_ms: _Optional[int] = ...) -> None: ...

class ListChangesRequest(_message.Message):
    __slots__ = ("after_change_id",)
    AFTER_CHANGE_ID_FIELD_NUMBER: _ClassVar[int]
    after_change_id: str
    def __init__(self, after_change_id: _Optional[str] = ...) -> None: ...

class ListChangesResponse(_message.Message):
    __slots__ = ("nodes", "change_id", "full", "server_unix_ms")
    NODES_FIELD_NUMBER: _ClassVar[int]
    CHANGE_ID_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    SERVER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    change_id: str
    full: bool
    server_unix_ms: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., change_id: _Optional[str] = ..., full: _Optional[bool] = ..., server_unix_ms: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_event_id",)
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    after_event_id: str
    def __init__(self, after_event_id: _Optional[str] = ...) -> None: ...

class NodeEvent(_message.Message):
    __slots__ = ("event_id", "type", "instance_id", "role", "address", "unix_ms", "reason")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    type: NodeEventType
    instance_id: str
    role: _common_pb2.Role
    address: str
    unix_ms: int
    reason: str
    def __init__(self, event_id: _Optional[str] = ..., type: _Optional[_Union[NodeEventType, str]] = ..., instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., unix_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...
