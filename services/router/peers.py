"""The router's gRPC edge to the control plane: the scheduler and the slot broker as
domain calls (workers are `services.worker.client.WorkerPool`).

`ControlPlane` implements the `Control` protocol of `services.router.flow`, so the flow
itself never sees gRPC. Failed calls raise the `kvrs.errors` exception matching their
status code (UNAVAILABLE -> Unavailable, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvrs.client import KvrsClient
from kvrs.learning import Outcome
from kvrs.recovery import Action
from kvrs.v1 import scheduler_pb2
from services.common.core_pb import ACTION_FROM_PB, option_from_pb
from services.common.outcomes import outcome_to_pb, terms_from_pb
from services.router.records import Decision, Endpoint, Placement


@dataclass(frozen=True)
class RecoverItem:
    """One request of a RecoverBatch (or a Recover) call."""

    request_id: str
    source_prefill_id: str
    prompt_tokens: int
    generated_tokens: int
    deadline_unix_ms: int = 0
    source_kv_lost: bool = False


class ControlPlane:
    """The scheduler (with replica failover) and the slot broker, through KvrsClient."""

    def __init__(self, client: KvrsClient) -> None:
        self.client = client

    async def select_decode(
        self,
        request_id: str,
        prefill_id: str,
        prompt_tokens: int,
        prefix_hashes: Sequence[int],
        policy: str,
        candidate_ids: Sequence[str] = (),
    ) -> Placement:
        reply = await self.client.select_decode(
            prefill_id,
            prompt_tokens,
            prefix_hashes=prefix_hashes,
            policy=policy,
            candidate_instance_ids=candidate_ids,
            request_id=request_id,
        )
        return Placement(
            decode=Endpoint(reply.decode_instance_id, reply.decode_address),
            predicted_ttft_s=reply.predicted_ttft_s,
            kv_bytes=reply.kv_bytes,
            policy=reply.policy,
            predicted=terms_from_pb(reply.predicted_terms),
        )

    async def recover(
        self,
        item: RecoverItem,
        failed_id: str,
        policy: str,
        exclude_ids: Sequence[str] = (),
    ) -> Decision:
        reply = await self.client.recover(
            item.request_id,
            failed_instance_id=failed_id,
            source_prefill_instance_id=item.source_prefill_id,
            prompt_tokens=item.prompt_tokens,
            generated_tokens=item.generated_tokens,
            deadline_unix_ms=item.deadline_unix_ms,
            policy=policy,
            source_kv_lost=item.source_kv_lost,
            exclude_instance_ids=exclude_ids,
        )
        return decision_from_pb(reply, batch_size=1)

    async def recover_batch(
        self, items: Sequence[RecoverItem], failed_id: str, policy: str
    ) -> list[Decision]:
        reply = await self.client.recover_batch(
            failed_id,
            [
                scheduler_pb2.RecoverItem(
                    request_id=item.request_id,
                    source_prefill_instance_id=item.source_prefill_id,
                    prompt_tokens=item.prompt_tokens,
                    generated_tokens=item.generated_tokens,
                    deadline_unix_ms=item.deadline_unix_ms,
                    source_kv_lost=item.source_kv_lost,
                )
                for item in items
            ],
            policy=policy,
        )
        return [decision_from_pb(d, batch_size=len(items)) for d in reply.decisions]

    async def report_outcome(self, outcome: Outcome) -> None:
        await self.client.report_outcome(outcome_to_pb(outcome))

    async def renew_slot(self, lease_id: str) -> int:
        """Extends a lease; returns its new expiry (unix ms)."""
        lease = await self.client.renew_slot(lease_id)
        return lease.expires_unix_ms

    async def release_slot(self, lease_id: str) -> bool:
        return await self.client.release_slot(lease_id)


def decision_from_pb(reply: scheduler_pb2.RecoverResponse, batch_size: int) -> Decision:
    lease = reply.slot_lease if reply.HasField("slot_lease") else None
    return Decision(
        request_id=reply.request_id,
        action=ACTION_FROM_PB.get(reply.action, Action.ABORT),
        target=Endpoint(reply.target_instance_id, reply.target_address),
        source=Endpoint(reply.source_instance_id, reply.source_address),
        split_tokens=reply.hybrid_split_tokens,
        predicted_cost_s=reply.predicted_cost_s,
        slo_slack_s=reply.slo_slack_s if not math.isnan(reply.slo_slack_s) else math.inf,
        reason=reply.reason,
        options=tuple(option_from_pb(option) for option in reply.options),
        lease_id=lease.lease_id if lease is not None and lease.lease_id else "",
        lease_expires_unix_ms=lease.expires_unix_ms if lease is not None else 0,
        batch_size=batch_size,
        predicted=terms_from_pb(reply.predicted_terms),
    )
