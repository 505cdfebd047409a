from kvrs.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EstimateTransferRequest(_message.Message):
    __slots__ = ("src_instance_id", "dst_instance_id", "kv_bytes", "tokens")
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    src_instance_id: str
    dst_instance_id: str
    kv_bytes: int
    tokens: int
    def __init__(self, src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class EstimateTransferResponse(_message.Message):
    __slots__ = ("estimate",)
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    estimate: _common_pb2.TransferEstimate
    def __init__(self, estimate: _Optional[_Union[_common_pb2.TransferEstimate, _Mapping]] = ...) -> None: ...

class GetCostMatrixRequest(_message.Message):
    __slots__ = ("prefill_instance_ids", "decode_instance_ids", "kv_bytes", "tokens")
    PREFILL_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    decode_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_bytes: int
    tokens: int
    def __init__(self, prefill_instance_ids: _Optional[_Iterable[str]] = ..., decode_instance_ids: _Optional[_Iterable[str]] = ..., kv_bytes: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class CostMatrixRow(_message.Message):
    __slots__ = ("prefill_instance_id", "to_decode")
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TO_DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill_instance_id: str
    to_decode: _containers.RepeatedCompositeFieldContainer[_common_pb2.TransferEstimate]
    def __init__(self, prefill_instance_id: _Optional[str] = ..., to_decode: _Optional[_Iterable[_Union[_common_pb2.TransferEstimate, _Mapping]]] = ...) -> None: ...

class GetCostMatrixResponse(_message.Message):
    __slots__ = ("rows", "decode_instance_ids")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[CostMatrixRow]
    decode_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rows: _Optional[_Iterable[_Union[CostMatrixRow, _Mapping]]] = ..., decode_instance_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EstimateComputeRequest(_message.Message):
    __slots__ = ("cached_tokens", "new_tokens")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    new_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ...) -> None: ...

class EstimateComputeResponse(_message.Message):
    __slots__ = ("compute_s", "kv_bytes", "model")
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    compute_s: float
    kv_bytes: int
    model: str
    def __init__(self, compute_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
