"""The router's gRPC edge to the control plane: the scheduler and the slot broker as
domain calls (workers are `services.worker.client.WorkerPool`).

`ControlPlane` implements the `Control` protocol of `services.router.flow`, so the flow
itself never sees gRPC. Failed calls raise the `kvrs.errors` exception matching their
status code (UNAVAILABLE -> Unavailable, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvrs.client import KvrsClient
from kvrs.learning import Outcome
from kvrs.prefill import PrefillOption
from kvrs.recovery import Action, RecoveryRequest
from kvrs.v1 import scheduler_pb2
from services.common.core_pb import ACTION_FROM_PB, option_from_pb
from services.common.outcomes import outcome_to_pb, terms_from_pb
from services.router.records import Decision, Endpoint, Placement


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
        exclude_ids: Sequence[str] = (),
        streamed: bool = False,
        prefill_options: Sequence[PrefillOption] = (),
    ) -> Placement:
        reply = await self.client.select_decode(
            prefill_id,
            prompt_tokens,
            prefix_hashes=prefix_hashes,
            policy=policy,
            candidate_instance_ids=candidate_ids,
            exclude_instance_ids=exclude_ids,
            request_id=request_id,
            streamed=streamed,
            prefill_options=prefill_options,
        )
        return Placement(
            decode=Endpoint(reply.decode_instance_id, reply.decode_address),
            predicted_ttft_s=reply.predicted_ttft_s,
            kv_bytes=reply.kv_bytes,
            policy=reply.policy,
            predicted=terms_from_pb(reply.predicted_terms),
            prefill_id=reply.prefill_instance_id or prefill_id,
        )

    async def recover(self, request: RecoveryRequest, failed_id: str, policy: str) -> Decision:
        """Recover for `request` (its `exclude_ids` are the instances it lost before)."""
        reply = await self.client.recover(
            request.request_id,
            failed_instance_id=failed_id,
            source_prefill_instance_id=request.source_prefill_id,
            prompt_tokens=request.prompt_tokens,
            generated_tokens=request.generated_tokens,
            deadline_unix_ms=_unix_ms(request.deadline_s),
            policy=policy,
            source_kv_lost=not request.source_kv_available,
            exclude_instance_ids=sorted(request.exclude_ids - {failed_id}),
            prefix_hashes=request.prefix_hashes,
        )
        return decision_from_pb(reply, batch_size=1)

    async def recover_batch(
        self, requests: Sequence[RecoveryRequest], failed_id: str, policy: str
    ) -> list[Decision]:
        reply = await self.client.recover_batch(
            failed_id,
            [
                scheduler_pb2.RecoverItem(
                    request_id=request.request_id,
                    source_prefill_instance_id=request.source_prefill_id,
                    prompt_tokens=request.prompt_tokens,
                    generated_tokens=request.generated_tokens,
                    deadline_unix_ms=_unix_ms(request.deadline_s),
                    source_kv_lost=not request.source_kv_available,
                    prefix_hashes=request.prefix_hashes,
                )
                for request in requests
            ],
            policy=policy,
        )
        return [decision_from_pb(d, batch_size=len(requests)) for d in reply.decisions]

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


def _unix_ms(deadline_s: float | None) -> int:
    """A deadline in unix seconds as the protos carry it (0 = none)."""
    return 0 if deadline_s is None else round(deadline_s * 1000)
