"""The router's domain records: a request, the scheduler's answers, what happened to it.

No gRPC here: `servicer.py` builds a `GenerateInput` from protobuf and turns `Token` /
`Summary` back into it; `peers.py` turns the scheduler's replies into `Placement` and
`Decision`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from kvrs.errors import InvalidArgument
from kvrs.learning import Terms
from kvrs.placement import PLACEMENT_POLICY_NAMES
from kvrs.recovery import RECOVERY_POLICY_NAMES, Action, OptionCost
from kvrs.sampling import Sampling
from services.worker.client import Endpoint

FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

DETECTED_BY_STREAM = "decode_stream"
DETECTED_BY_GOSSIP = "gossip"
DETECTED_BY_TRANSFER = "transfer"


@dataclass(frozen=True)
class GenerateInput:
    """One Generate call, validated (see `validate`)."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    ttft_slo_s: float = 0.0
    deadline_unix_ms: int = 0
    placement_policy: str = ""
    recovery_policy: str = ""
    prefill_instance_id: str = ""
    decode_instance_id: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    """How tokens are drawn, its seed always set (the request's, else one from its id)."""

    def validate(self, vocab_size: int = 0, max_positions: int = 0) -> None:
        """InvalidArgument naming the first bad field; with the served model's vocabulary
        size and positions (0: unknown), a prompt it cannot take is refused here, before
        any worker holds KV for it."""
        if not self.request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if not self.prompt:
            raise InvalidArgument("prompt_token_ids", "must hold at least one token")
        for index, token in enumerate(self.prompt):
            if token < 0 or 0 < vocab_size <= token:
                raise InvalidArgument(
                    f"prompt_token_ids[{index}]",
                    f"token {token} is outside the vocabulary [0, {vocab_size or 'inf'})",
                )
        if 0 < max_positions < len(self.prompt):
            raise InvalidArgument(
                "prompt_token_ids",
                f"{len(self.prompt)} tokens exceed the model's {max_positions} positions",
            )
        if self.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.ttft_slo_s) or self.ttft_slo_s < 0:
            raise InvalidArgument(
                "ttft_slo_s", f"must be a finite number >= 0, got {self.ttft_slo_s}"
            )
        if self.deadline_unix_ms < 0:
            raise InvalidArgument("deadline_unix_ms", f"must be >= 0, got {self.deadline_unix_ms}")
        for field_name, value, known in (
            ("placement_policy", self.placement_policy, PLACEMENT_POLICY_NAMES),
            ("recovery_policy", self.recovery_policy, RECOVERY_POLICY_NAMES),
        ):
            if value and value not in known:
                raise InvalidArgument(
                    field_name, f"unknown policy {value!r} (known: {', '.join(known)})"
                )


@dataclass(frozen=True)
class Placement:
    """SelectDecode's answer."""

    decode: Endpoint
    predicted_ttft_s: float
    kv_bytes: int
    policy: str
    predicted: Terms = Terms()
    """The prediction term by term (with the first token's extend)."""
    prefill_id: str = ""
    """Where the prompt prefills: the instance asked about, or the prefill option a
    policy choosing prefill and decode together preferred."""


@dataclass(frozen=True)
class Decision:
    """Recover's (or one RecoverBatch item's) answer."""

    request_id: str
    action: Action
    target: Endpoint
    source: Endpoint
    split_tokens: int
    predicted_cost_s: float
    slo_slack_s: float
    reason: str
    options: tuple[OptionCost, ...] = ()
    lease_id: str = ""
    """The migration slot the scheduler reserved (MIGRATE / HYBRID); "" = none."""
    lease_expires_unix_ms: int = 0
    batch_size: int = 1
    predicted: Terms = Terms()
    """predicted_cost_s term by term."""


@dataclass(frozen=True)
class Token:
    """One generated token, in order from index 0."""

    index: int
    token_id: int


@dataclass
class RecoveryRecord:
    """One recovery attempt of one request, as the summary reports it."""

    failed_instance_id: str
    detected_by: str
    generated_tokens: int
    policy: str
    lost_reason: str = ""
    decision: Decision | None = None
    decision_s: float = 0.0
    measured_s: float = 0.0
    succeeded: bool = False
    error: str = ""
    measured: Terms = Terms()
    """measured_s term by term (first_token_s once the new decode instance streamed)."""


@dataclass
class Summary:
    """What the last stream message carries."""

    request_id: str
    prompt_tokens: int
    prefill_instance_id: str = ""
    decode_instance_id: str = ""
    final_decode_instance_id: str = ""
    generated_tokens: int = 0
    finish_reason: str = FINISH_LENGTH
    ttft_s: float = 0.0
    ttft_slo_met: bool = True
    total_s: float = 0.0
    predicted_ttft_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_bytes: int = 0
    prefix_hit_tokens: int = 0
    """Prompt tokens the prefill instance reused from its resident prefix blocks."""
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    trace_id: str = ""
    placement_measured_s: float = 0.0
    """SelectDecode's answer to the first decoded token."""
    placement_predicted_s: float = 0.0
    """The placement's prediction of `placement_measured_s`."""


@dataclass(frozen=True)
class Lost:
    """An instance this request depended on stopped answering."""

    instance_id: str
    detected_by: str
    reason: str
    source_lost: bool = False
    """The lost instance held the KV being moved (the prefill side), not the decode side."""
    unreachable: bool = True
    """The instance does not answer at all (nothing more is sent to it, not even a
    release); False when it answered with an error (e.g. its KV was evicted)."""


@dataclass
class Awaiting:
    """An executed decision whose outcome is complete once the next token streams."""

    kind: str
    """kvrs.learning KINDS: "placement" or the recovery action."""
    source_id: str
    target_id: str
    decided_unix_s: float
    started_s: float
    """Monotonic time the router received the decision."""
    kv_ready_s: float
    """Monotonic time the KV was ready on the target."""
    predicted: Terms
    measured: Terms
    kv_bytes: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    extend_tokens: int = 0
    target_running: int = 0
    target_jobs: int = 1
    """The most decisions this one ran beside on its target, itself included."""
    streamed: bool = False
    """The transfer ran while the source prefilled (layer-wise streaming)."""
    record: RecoveryRecord | None = None


@dataclass(eq=False)
class Run:
    """One request in flight: what it has produced and where its KV lives."""

    request: GenerateInput
    summary: Summary
    policy: str
    """The recovery policy it is planned with ("" = the scheduler's default)."""
    prefix_hashes: tuple[int, ...] = ()
    """The prompt's block hashes, computed once: the prefill choice, the placement, the
    pull and every recovery read them."""
    generated: list[int] = field(default_factory=list)
    prefill: Endpoint | None = None
    """The instance holding the prompt's KV (MIGRATE and HYBRID pull from it)."""
    prefill_kv_id: str = ""
    """The name of that KV there: the request id, or a recompute's own id."""
    prefill_kv_lost: bool = False
    decode: Endpoint | None = None
    kv_id: str = ""
    """The name of the KV on `decode` (the request id, or a recompute's own id)."""
    held: dict[tuple[str, str], Endpoint] = field(default_factory=dict)
    """Every (instance id, kv id) this request created, released when it ends."""
    failed: dict[str, float] = field(default_factory=dict)
    """Instances that failed this request, and when (monotonic s): recoveries exclude
    them until they register again."""
    unreachable: set[str] = field(default_factory=set)
    """Instances that stopped answering: nothing is released there (their KV died)."""
    recomputes: int = 0
    pending_loss: Lost | None = None
    """Set when a decode phase ended because its instance was lost."""
    awaiting: Awaiting | None = None
    """The decision whose outcome waits for the next streamed token."""
    span: Span | None = None
    """The request's span (outcomes land on it as events)."""

    @property
    def remaining_tokens(self) -> int:
        return self.request.max_new_tokens - len(self.generated)

    def hold(self, at: Endpoint, kv_id: str) -> None:
        self.held[(at.instance_id, kv_id)] = at

    def lose(self, lost: Lost) -> None:
        self.failed[lost.instance_id] = time.monotonic()
        if lost.unreachable:
            self.unreachable.add(lost.instance_id)
