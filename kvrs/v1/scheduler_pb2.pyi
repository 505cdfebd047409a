from kvrs.v1 import common_pb2 as _common_pb2
from kvrs.v1 import slots_pb2 as _slots_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectDecodeRequest(_message.Message):
    __slots__ = ("request_id", "prefill_instance_id", "prompt_tokens", "prefix_hashes", "policy", "exclude_instance_ids", "candidate_instance_ids", "streamed", "prefill_options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_instance_id: str
    prompt_tokens: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    policy: str
    exclude_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    candidate_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    streamed: bool
    prefill_options: _containers.RepeatedCompositeFieldContainer[PrefillOption]
    def __init__(self, request_id: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., policy: _Optional[str] = ..., exclude_instance_ids: _Optional[_Iterable[str]] = ..., candidate_instance_ids: _Optional[_Iterable[str]] = ..., streamed: _Optional[bool] = ..., prefill_options: _Optional[_Iterable[_Union[PrefillOption, _Mapping]]] = ...) -> None: ...

class PrefillOption(_message.Message):
    __slots__ = ("instance_id", "finish_s", "prefix_hit_tokens")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    finish_s: float
    prefix_hit_tokens: int
    def __init__(self, instance_id: _Optional[str] = ..., finish_s: _Optional[float] = ..., prefix_hit_tokens: _Optional[int] = ...) -> None: ...

class CandidateScore(_message.Message):
    __slots__ = ("instance_id", "score_s", "transfer_s", "wait_s", "prefix_hit_tokens", "tier")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    score_s: float
    transfer_s: float
    wait_s: float
    prefix_hit_tokens: int
    tier: int
    def __init__(self, instance_id: _Optional[str] = ..., score_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., prefix_hit_tokens: _Optional[int] = ..., tier: _Optional[int] = ...) -> None: ...

class SelectDecodeResponse(_message.Message):
    __slots__ = ("decode_instance_id", "decode_address", "predicted_ttft_s", "transfer_s", "wait_s", "prefix_hit_tokens", "kv_bytes", "transfer", "runner_up_instance_id", "runner_up_ttft_s", "policy", "view_stale", "view_age_s", "decode_transfer_address", "candidates_considered", "predicted_terms", "planned_jobs", "prefill_instance_id")
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    VIEW_STALE_FIELD_NUMBER: _ClassVar[int]
    VIEW_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_CONSIDERED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TERMS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_JOBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    decode_instance_id: str
    decode_address: str
    predicted_ttft_s: float
    transfer_s: float
    wait_s: float
    prefix_hit_tokens: int
    kv_bytes: int
    transfer: _common_pb2.TransferEstimate
    runner_up_instance_id: str
    runner_up_ttft_s: float
    policy: str
    view_stale: bool
    view_age_s: float
    decode_transfer_address: str
    candidates_considered: int
    predicted_terms: _common_pb2.DecisionTerms
    planned_jobs: int
    prefill_instance_id: str
    def __init__(self, decode_instance_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., predicted_ttft_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., prefix_hit_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., transfer: _Optional[_Union[_common_pb2.TransferEstimate, _Mapping]] = ..., runner_up_instance_id: _Optional[str] = ..., runner_up_ttft_s: _Optional[float] = ..., policy: _Optional[str] = ..., view_stale: _Optional[bool] = ..., view_age_s: _Optional[float] = ..., decode_transfer_address: _Optional[str] = ..., candidates_considered: _Optional[int] = ..., predicted_terms: _Optional[_Union[_common_pb2.DecisionTerms, _Mapping]] = ..., planned_jobs: _Optional[int] = ..., prefill_instance_id: _Optional[str] = ...) -> None: ...

class OptionCost(_message.Message):
    __slots__ = ("action", "target_instance_id", "source_instance_id", "cost_s", "wait_s", "transfer_s", "compute_s", "split_tokens", "feasible", "infeasible_reason")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COST_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SPLIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    INFEASIBLE_REASON_FIELD_NUMBER: _ClassVar[int]
    action: _common_pb2.RecoveryAction
    target_instance_id: str
    source_instance_id: str
    cost_s: float
    wait_s: float
    transfer_s: float
    compute_s: float
    split_tokens: int
    feasible: bool
    infeasible_reason: str
    def __init__(self, action: _Optional[_Union[_common_pb2.RecoveryAction, str]] = ..., target_instance_id: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., cost_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., split_tokens: _Optional[int] = ..., feasible: _Optional[bool] = ..., infeasible_reason: _Optional[str] = ...) -> None: ...

class RecoverRequest(_message.Message):
    __slots__ = ("request_id", "failed_instance_id", "source_prefill_instance_id", "prompt_tokens", "generated_tokens", "deadline_unix_ms", "policy", "source_kv_lost", "exclude_instance_ids", "skip_slot", "prefix_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KV_LOST_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SLOT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    failed_instance_id: str
    source_prefill_instance_id: str
    prompt_tokens: int
    generated_tokens: int
    deadline_unix_ms: int
    policy: str
    source_kv_lost: bool
    exclude_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    skip_slot: bool
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., failed_instance_id: _Optional[str] = ..., source_prefill_instance_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., policy: _Optional[str] = ..., source_kv_lost: _Optional[bool] = ..., exclude_instance_ids: _Optional[_Iterable[str]] = ..., skip_slot: _Optional[bool] = ..., prefix_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class RecoverResponse(_message.Message):
    __slots__ = ("request_id", "action", "target_instance_id", "target_address", "source_instance_id", "source_address", "predicted_cost_s", "options", "hybrid_split_tokens", "slot_lease", "reason", "slo_slack_s", "view_stale", "view_age_s", "runner_up", "target_transfer_address", "source_transfer_address", "predicted_terms", "planned_jobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COST_S_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    HYBRID_SPLIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SLO_SLACK_S_FIELD_NUMBER: _ClassVar[int]
    VIEW_STALE_FIELD_NUMBER: _ClassVar[int]
    VIEW_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_FIELD_NUMBER: _ClassVar[int]
    TARGET_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TERMS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_JOBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    action: _common_pb2.RecoveryAction
    target_instance_id: str
    target_address: str
    source_instance_id: str
    source_address: str
    predicted_cost_s: float
    options: _containers.RepeatedCompositeFieldContainer[OptionCost]
    hybrid_split_tokens: int
    slot_lease: _slots_pb2.SlotLease
    reason: str
    slo_slack_s: float
    view_stale: bool
    view_age_s: float
    runner_up: str
    target_transfer_address: str
    source_transfer_address: str
    predicted_terms: _common_pb2.DecisionTerms
    planned_jobs: int
    def __init__(self, request_id: _Optional[str] = ..., action: _Optional[_Union[_common_pb2.RecoveryAction, str]] = ..., target_instance_id: _Optional[str] = ..., target_address: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., source_address: _Optional[str] = ..., predicted_cost_s: _Optional[float] = ..., options: _Optional[_Iterable[_Union[OptionCost, _Mapping]]] = ..., hybrid_split_tokens: _Optional[int] = ..., slot_lease: _Optional[_Union[_slots_pb2.SlotLease, _Mapping]] = ..., reason: _Optional[str] = ..., slo_slack_s: _Optional[float] = ..., view_stale: _Optional[bool] = ..., view_age_s: _Optional[float] = ..., runner_up: _Optional[str] = ..., target_transfer_address: _Optional[str] = ..., source_transfer_address: _Optional[str] = ..., predicted_terms: _Optional[_Union[_common_pb2.DecisionTerms, _Mapping]] = ..., planned_jobs: _Optional[int] = ...) -> None: ...

class RecoverItem(_message.Message):
    __slots__ = ("request_id", "source_prefill_instance_id", "prompt_tokens", "generated_tokens", "deadline_unix_ms", "source_kv_lost", "prefix_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KV_LOST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_prefill_instance_id: str
    prompt_tokens: int
    generated_tokens: int
    deadline_unix_ms: int
    source_kv_lost: bool
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., source_prefill_instance_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., source_kv_lost: _Optional[bool] = ..., prefix_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class RecoverBatchRequest(_message.Message):
    __slots__ = ("batch_id", "failed_instance_id", "items", "policy", "skip_slot")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SLOT_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    failed_instance_id: str
    items: _containers.RepeatedCompositeFieldContainer[RecoverItem]
    policy: str
    skip_slot: bool
    def __init__(self, batch_id: _Optional[str] = ..., failed_instance_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[RecoverItem, _Mapping]]] = ..., policy: _Optional[str] = ..., skip_slot: _Optional[bool] = ...) -> None: ...

class RecoverBatchResponse(_message.Message):
    __slots__ = ("decisions", "planned_makespan_s")
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_MAKESPAN_S_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[RecoverResponse]
    planned_makespan_s: float
    def __init__(self, decisions: _Optional[_Iterable[_Union[RecoverResponse, _Mapping]]] = ..., planned_makespan_s: _Optional[float] = ...) -> None: ...

class DecisionOutcome(_message.Message):
    __slots__ = ("kind", "request_id", "source_instance_id", "target_instance_id", "decided_unix_ms", "predicted", "measured", "kv_bytes", "prefill_tokens", "cached_tokens", "extend_tokens", "target_running_requests", "target_jobs", "streamed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECIDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_JOBS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    request_id: str
    source_instance_id: str
    target_instance_id: str
    decided_unix_ms: int
    predicted: _common_pb2.DecisionTerms
    measured: _common_pb2.DecisionTerms
    kv_bytes: int
    prefill_tokens: int
    cached_tokens: int
    extend_tokens: int
    target_running_requests: int
    target_jobs: int
    streamed: bool
    def __init__(self, kind: _Optional[str] = ..., request_id: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., target_instance_id: _Optional[str] = ..., decided_unix_ms: _Optional[int] = ..., predicted: _Optional[_Union[_common_pb2.DecisionTerms, _Mapping]] = ..., measured: _Optional[_Union[_common_pb2.DecisionTerms, _Mapping]] = ..., kv_bytes: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., extend_tokens: _Optional[int] = ..., target_running_requests: _Optional[int] = ..., target_jobs: _Optional[int] = ..., streamed: _Optional[bool] = ...) -> None: ...

class ReportOutcomeRequest(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: DecisionOutcome
    def __init__(self, outcome: _Optional[_Union[DecisionOutcome, _Mapping]] = ...) -> None: ...

class ReportOutcomeResponse(_message.Message):
    __slots__ = ("stored_outcomes",)
    STORED_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    stored_outcomes: int
    def __init__(self, stored_outcomes: _Optional[int] = ...) -> None: ...

class GetCorrectionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkCorrection(_message.Message):
    __slots__ = ("src_instance_id", "dst_instance_id", "fixed_s", "bandwidth_bps", "samples")
    SRC_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FIXED_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    src_instance_id: str
    dst_instance_id: str
    fixed_s: float
    bandwidth_bps: float
    samples: int
    def __init__(self, src_instance_id: _Optional[str] = ..., dst_instance_id: _Optional[str] = ..., fixed_s: _Optional[float] = ..., bandwidth_bps: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class TermError(_message.Message):
    __slots__ = ("kind", "term", "p50", "p90", "samples")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    term: str
    p50: float
    p90: float
    samples: int
    def __init__(self, kind: _Optional[str] = ..., term: _Optional[str] = ..., p50: _Optional[float] = ..., p90: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class GetCorrectionsResponse(_message.Message):
    __slots__ = ("links", "compute_factor", "wait_per_decode_s", "errors", "samples", "worker_wait_s")
    class WorkerWaitSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LINKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    WAIT_PER_DECODE_S_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WORKER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkCorrection]
    compute_factor: float
    wait_per_decode_s: float
    errors: _containers.RepeatedCompositeFieldContainer[TermError]
    samples: int
    worker_wait_s: _containers.ScalarMap[str, float]
    def __init__(self, links: _Optional[_Iterable[_Union[LinkCorrection, _Mapping]]] = ..., compute_factor: _Optional[float] = ..., wait_per_decode_s: _Optional[float] = ..., errors: _Optional[_Iterable[_Union[TermError, _Mapping]]] = ..., samples: _Optional[int] = ..., worker_wait_s: _Optional[_Mapping[str, float]] = ...) -> None: ...
