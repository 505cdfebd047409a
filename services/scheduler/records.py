"""The scheduler's decision records: what a caller asks, and what a decision answers.

Plain data between the servicer (which translates them to and from protobuf) and
`decisions.Scheduler` (which fills them in).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrs.learning import Terms
from kvrs.network import TransferEstimate
from kvrs.placement import Placement
from kvrs.prefill import PrefillOption
from kvrs.recovery import RecoveryDecision
from services.scheduler.leases import Lease


class SlotOutcome:
    """What happened at the slot broker for one decision (the `kvrs.slot.outcome` values)."""

    GRANTED = "granted"
    EXHAUSTED = "exhausted"
    UNREACHABLE = "broker_unreachable"
    REFUSED = "refused"
    SKIPPED = "skipped"
    NOT_NEEDED = "not_needed"


@dataclass(frozen=True)
class SelectDecodeInput:
    """A SelectDecode request, validated by the scheduler (not here) so errors name fields."""

    request_id: str
    prefill_id: str
    prompt_tokens: int
    prefix_hashes: tuple[int, ...] = ()
    policy: str = ""
    exclude_ids: frozenset[str] = frozenset()
    candidate_ids: frozenset[str] = frozenset()
    streamed: bool = False
    """The KV streams while the prompt prefills (layer-wise streaming)."""
    prefill_options: tuple[PrefillOption, ...] = ()
    """Where else the prompt could prefill (prefill_id among them), for a policy that
    chooses prefill and decode together; empty: it prefills on prefill_id."""


@dataclass(frozen=True)
class Selection:
    """The placement and where to reach the chosen instance, with the view's age."""

    placement: Placement
    address: str
    transfer_address: str
    view_age_s: float
    view_stale: bool
    predicted: Terms = Terms()
    """predicted_ttft_s term by term, with the first token's extend."""
    planned_jobs: int = 1
    """Decisions the prediction counts on the chosen instance, this one included."""
    prefill_id: str = ""
    """Where the prompt prefills: the request's prefill_id or another of its options."""


@dataclass(frozen=True)
class Endpoint:
    """An instance and its worker / transfer addresses, as the view knew them."""

    instance_id: str = ""
    address: str = ""
    transfer_address: str = ""


@dataclass(frozen=True)
class RecoveryOutcome:
    """A recovery decision with its slot lease (if one was needed and granted)."""

    decision: RecoveryDecision
    reason: str
    lease: Lease | None
    slot_outcome: str
    target: Endpoint
    source: Endpoint
    view_age_s: float
    view_stale: bool
    replayed: bool = False
    transfer: TransferEstimate | None = None
    """The chosen option's KV transfer as priced now (for the decision span)."""
    predicted: Terms = Terms()
    """The chosen option's cost term by term."""
    planned_jobs: int = 1
    """Recoveries the prediction counts on the target, this one included."""


@dataclass(frozen=True)
class BatchOutcome:
    """Every request's outcome, in the order the requests came."""

    outcomes: tuple[RecoveryOutcome, ...]
    makespan_s: float
    slots_free: int
