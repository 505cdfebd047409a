from kvrs.v1 import common_pb2 as _common_pb2
from kvrs.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_new_tokens", "ttft_slo_s", "deadline_unix_ms", "placement_policy", "recovery_policy", "prefill_instance_id", "decode_instance_id", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    ttft_slo_s: float
    deadline_unix_ms: int
    placement_policy: str
    recovery_policy: str
    prefill_instance_id: str
    decode_instance_id: str
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., ttft_slo_s: _Optional[float] = ..., deadline_unix_ms: _Optional[int] = ..., placement_policy: _Optional[str] = ..., recovery_policy: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., decode_instance_id: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("index", "token_id", "summary")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    summary: GenerateSummary
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("request_id", "prefill_instance_id", "decode_instance_id", "final_decode_instance_id", "prompt_tokens", "generated_tokens", "finish_reason", "ttft_s", "ttft_slo_met", "total_s", "predicted_ttft_s", "prefill_s", "kv_transfer_s", "kv_bytes", "recoveries", "trace_id", "placement_measured_s", "placement_predicted_s", "prefix_hit_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_MEASURED_S_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_instance_id: str
    decode_instance_id: str
    final_decode_instance_id: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    ttft_s: float
    ttft_slo_met: bool
    total_s: float
    predicted_ttft_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_bytes: int
    recoveries: _containers.RepeatedCompositeFieldContainer[RecoveryReport]
    trace_id: str
    placement_measured_s: float
    placement_predicted_s: float
    prefix_hit_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., decode_instance_id: _Optional[str] = ..., final_decode_instance_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., ttft_s: _Optional[float] = ..., ttft_slo_met: _Optional[bool] = ..., total_s: _Optional[float] = ..., predicted_ttft_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., recoveries: _Optional[_Iterable[_Union[RecoveryReport, _Mapping]]] = ..., trace_id: _Optional[str] = ..., placement_measured_s: _Optional[float] = ..., placement_predicted_s: _Optional[float] = ..., prefix_hit_tokens: _Optional[int] = ...) -> None: ...

class RecoveryReport(_message.Message):
    __slots__ = ("failed_instance_id", "detected_by", "generated_tokens", "action", "target_instance_id", "source_instance_id", "split_tokens", "predicted_cost_s", "options", "slo_slack_s", "reason", "policy", "batch_size", "measured_s", "decision_s", "succeeded", "error", "predicted_terms", "measured_terms", "lost_reason")
    FAILED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DETECTED_BY_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COST_S_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SLO_SLACK_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_S_FIELD_NUMBER: _ClassVar[int]
    DECISION_S_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TERMS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TERMS_FIELD_NUMBER: _ClassVar[int]
    LOST_REASON_FIELD_NUMBER: _ClassVar[int]
    failed_instance_id: str
    detected_by: str
    generated_tokens: int
    action: _common_pb2.RecoveryAction
    target_instance_id: str
    source_instance_id: str
    split_tokens: int
    predicted_cost_s: float
    options: _containers.RepeatedCompositeFieldContainer[_scheduler_pb2.OptionCost]
    slo_slack_s: float
    reason: str
    policy: str
    batch_size: int
    measured_s: float
    decision_s: float
    succeeded: bool
    error: str
    predicted_terms: _common_pb2.DecisionTerms
    measured_terms: _common_pb2.DecisionTerms
    lost_reason: str
    def __init__(self, failed_instance_id: _Optional[str] = ..., detected_by: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., action: _Optional[_Union[_common_pb2.RecoveryAction, str]] = ..., target_instance_id: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., split_tokens: _Optional[int] = ..., predicted_cost_s: _Optional[float] = ..., options: _Optional[_Iterable[_Union[_scheduler_pb2.OptionCost, _Mapping]]] = ..., slo_slack_s: _Optional[float] = ..., reason: _Optional[str] = ..., policy: _Optional[str] = ..., batch_size: _Optional[int] = ..., measured_s: _Optional[float] = ..., decision_s: _Optional[float] = ..., succeeded: _Optional[bool] = ..., error: _Optional[str] = ..., predicted_terms: _Optional[_Union[_common_pb2.DecisionTerms, _Mapping]] = ..., measured_terms: _Optional[_Union[_common_pb2.DecisionTerms, _Mapping]] = ..., lost_reason: _Optional[str] = ...) -> None: ...
