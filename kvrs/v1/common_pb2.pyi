from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class RecoveryAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_ACTION_UNSPECIFIED: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_MIGRATE: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_RECOMPUTE: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_HYBRID: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_ABORT: _ClassVar[RecoveryAction]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
RECOVERY_ACTION_UNSPECIFIED: RecoveryAction
RECOVERY_ACTION_MIGRATE: RecoveryAction
RECOVERY_ACTION_RECOMPUTE: RecoveryAction
RECOVERY_ACTION_HYBRID: RecoveryAction
RECOVERY_ACTION_ABORT: RecoveryAction

class Location(_message.Message):
    __slots__ = ("node", "rack", "pod", "gpu_index")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    node: str
    rack: str
    pod: str
    gpu_index: int
    def __init__(self, node: _Optional[str] = ..., rack: _Optional[str] = ..., pod: _Optional[str] = ..., gpu_index: _Optional[int] = ...) -> None: ...

class TransferEstimate(_message.Message):
    __slots__ = ("src_instance_id", "dst_instance_id", "kv_bytes", "transfer_s", "tier", "bottleneck_bandwidth_bps", "rtt_s", "telemetry_age_s", "telemetry_stale", "flows_on_path")
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_AGE_S_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_STALE_FIELD_NUMBER: _ClassVar[int]
    FLOWS_ON_PATH_FIELD_NUMBER: _ClassVar[int]
    src_instance_id: str
    dst_instance_id: str
    kv_bytes: int
    transfer_s: float
    tier: int
    bottleneck_bandwidth_bps: float
    rtt_s: float
    telemetry_age_s: float
    telemetry_stale: bool
    flows_on_path: int
    def __init__(self, src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., tier: _Optional[int] = ..., bottleneck_bandwidth_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ..., telemetry_age_s: _Optional[float] = ..., telemetry_stale: _Optional[bool] = ..., flows_on_path: _Optional[int] = ...) -> None: ...

class DecisionTerms(_message.Message):
    __slots__ = ("source_wait_s", "target_wait_s", "setup_s", "stream_s", "prefill_s", "extend_s", "total_s", "first_token_s")
    SOURCE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SETUP_S_FIELD_NUMBER: _ClassVar[int]
    STREAM_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    EXTEND_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    source_wait_s: float
    target_wait_s: float
    setup_s: float
    stream_s: float
    prefill_s: float
    extend_s: float
    total_s: float
    first_token_s: float
    def __init__(self, source_wait_s: _Optional[float] = ..., target_wait_s: _Optional[float] = ..., setup_s: _Optional[float] = ..., stream_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., extend_s: _Optional[float] = ..., total_s: _Optional[float] = ..., first_token_s: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...
