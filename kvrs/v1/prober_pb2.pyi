from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbeLinkRequest(_message.Message):
    __slots__ = ("src_instance_id", "dst_instance_id", "probe_bytes")
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    src_instance_id: str
    dst_instance_id: str
    probe_bytes: int
    def __init__(self, src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., probe_bytes: _Optional[int] = ...) -> None: ...

class LinkEstimate(_message.Message):
    __slots__ = ("src_instance_id", "dst_instance_id", "bandwidth_bps", "sample_bandwidth_bps", "rtt_s", "probe_bytes", "probe_s", "samples", "age_s", "measured_unix_ms", "probe_time_fraction", "last_error")
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROBE_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PROBE_TIME_FRACTION_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    src_instance_id: str
    dst_instance_id: str
    bandwidth_bps: float
    sample_bandwidth_bps: float
    rtt_s: float
    probe_bytes: int
    probe_s: float
    samples: int
    age_s: float
    measured_unix_ms: int
    probe_time_fraction: float
    last_error: str
    def __init__(self, src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., bandwidth_bps: _Optional[float] = ..., sample_bandwidth_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ..., probe_bytes: _Optional[int] = ..., probe_s: _Optional[float] = ..., samples: _Optional[int] = ..., age_s: _Optional[float] = ..., measured_unix_ms: _Optional[int] = ..., probe_time_fraction: _Optional[float] = ..., last_error: _Optional[str] = ...) -> None: ...

class ProbeLinkResponse(_message.Message):
    __slots__ = ("link",)
    LINK_FIELD_NUMBER: _ClassVar[int]
    link: LinkEstimate
    def __init__(self, link: _Optional[_Union[LinkEstimate, _Mapping]] = ...) -> None: ...

class ListLinkEstimatesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLinkEstimatesResponse(_message.Message):
    __slots__ = ("links", "probe_time_fraction", "probe_budget_fraction", "probes_total", "probe_failures_total")
    LINKS_FIELD_NUMBER: _ClassVar[int]
    PROBE_TIME_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PROBE_BUDGET_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PROBES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROBE_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkEstimate]
    probe_time_fraction: float
    probe_budget_fraction: float
    probes_total: int
    probe_failures_total: int
    def __init__(self, links: _Optional[_Iterable[_Union[LinkEstimate, _Mapping]]] = ..., probe_time_fraction: _Optional[float] = ..., probe_budget_fraction: _Optional[float] = ..., probes_total: _Optional[int] = ..., probe_failures_total: _Optional[int] = ...) -> None: ...
