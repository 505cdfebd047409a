from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SlotLease(_message.Message):
    __slots__ = ("lease_id", "request_id", "holder_id", "src_instance_id", "dst_instance_id", "expires_unix_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    holder_id: str
    src_instance_id: str
    dst_instance_id: str
    expires_unix_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ..., holder_id: _Optional[str] = ..., src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class ReserveSlotRequest(_message.Message):
    __slots__ = ("request_id", "holder_id", "src_instance_id", "dst_instance_id", "ttl_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    holder_id: str
    src_instance_id: str
    dst_instance_id: str
    ttl_s: float
    def __init__(self, request_id: _Optional[str] = ..., holder_id: _Optional[str] = ..., src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ReserveSlotResponse(_message.Message):
    __slots__ = ("lease", "slots_in_use", "cluster_cap")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_CAP_FIELD_NUMBER: _ClassVar[int]
    lease: SlotLease
    slots_in_use: int
    cluster_cap: int
    def __init__(self, lease: _Optional[_Union[SlotLease, _Mapping]] = ..., slots_in_use: _Optional[int] = ..., cluster_cap: _Optional[int] = ...) -> None: ...

class RenewSlotRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewSlotResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: SlotLease
    def __init__(self, lease: _Optional[_Union[SlotLease, _Mapping]] = ...) -> None: ...

class ReleaseSlotRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseSlotResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetSlotStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkSlotStats(_message.Message):
    __slots__ = ("src_instance_id", "dst_instance_id", "in_use", "cap")
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    CAP_FIELD_NUMBER: _ClassVar[int]
    src_instance_id: str
    dst_instance_id: str
    in_use: int
    cap: int
    def __init__(self, src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., in_use: _Optional[int] = ..., cap: _Optional[int] = ...) -> None: ...

class GetSlotStatsResponse(_message.Message):
    __slots__ = ("slots_in_use", "cluster_cap", "links", "granted_total", "denied_total", "expired_total", "spare_slots", "spares_lapsed_total")
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_CAP_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DENIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPARE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SPARES_LAPSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    slots_in_use: int
    cluster_cap: int
    links: _containers.RepeatedCompositeFieldContainer[LinkSlotStats]
    granted_total: int
    denied_total: int
    expired_total: int
    spare_slots: int
    spares_lapsed_total: int
    def __init__(self, slots_in_use: _Optional[int] = ..., cluster_cap: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkSlotStats, _Mapping]]] = ..., granted_total: _Optional[int] = ..., denied_total: _Optional[int] = ..., expired_total: _Optional[int] = ..., spare_slots: _Optional[int] = ..., spares_lapsed_total: _Optional[int] = ...) -> None: ...
