"""The router's gRPC edge: workers, the scheduler and the slot broker as domain calls.

`WorkerPool` and `ControlPlane` implement the `Workers` and `Control` protocols of
`services.router.flow`, so the flow itself never sees gRPC. Failed calls raise the
`kvrs.errors` exception matching their status code (UNAVAILABLE -> Unavailable, ...),
with a message naming the instance.

Worker calls are never retried here: a worker that does not answer is a failed
instance, and the flow recovers from it (retrying would only delay the recovery). A
channel whose call failed with UNAVAILABLE is dropped, so a worker restarted at the same
address is dialled afresh instead of after gRPC's reconnect backoff.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs import errors
from kvrs.client import KvrsClient
from kvrs.recovery import Action, OptionCost
from kvrs.rpc import error_from_rpc
from kvrs.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.router.records import Decision, Endpoint, Placement

ACTION_FROM_PB = {
    common_pb2.RECOVERY_ACTION_MIGRATE: Action.MIGRATE,
    common_pb2.RECOVERY_ACTION_RECOMPUTE: Action.RECOMPUTE,
    common_pb2.RECOVERY_ACTION_HYBRID: Action.HYBRID,
    common_pb2.RECOVERY_ACTION_ABORT: Action.ABORT,
}


@dataclass(frozen=True)
class Prefilled:
    first_token_id: int
    kv_bytes: int
    prefill_s: float


@dataclass(frozen=True)
class Pulled:
    kv_bytes: int
    transfer_s: float
    total_s: float
    recomputed_tokens: int


@dataclass(frozen=True)
class RecoverItem:
    """One request of a RecoverBatch (or a Recover) call."""

    request_id: str
    source_prefill_id: str
    prompt_tokens: int
    generated_tokens: int
    deadline_unix_ms: int = 0
    source_kv_lost: bool = False


DROPPED_CHANNEL_GRACE_S = 3600.0
"""How long calls on a dropped worker channel may still run before it is closed."""


class WorkerPool:
    """Channels to workers by address, opened on first use and dropped when unreachable."""

    def __init__(
        self,
        settings: GrpcSettings,
        provider: TracerProvider | None,
        timeout_s: float,
    ) -> None:
        self._settings = settings
        self._provider = provider
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerServiceStub] = {}
        self._closing: dict[asyncio.Task, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self._settings, self._provider)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerServiceStub(channel)
        return stub

    def _failed(self, exc: grpc.aio.AioRpcError, at: Endpoint) -> errors.KvrsError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._drop(at.address)
        return error_from_rpc(exc, f"{at.instance_id} at {at.address}")

    def _drop(self, address: str) -> None:
        """New calls to `address` get a new channel; calls still running on the old one
        finish there (closing it at once would cancel them, and a cancelled grpc.aio call
        raises CancelledError in whichever request made it)."""
        channel = self._channels.pop(address, None)
        self._stubs.pop(address, None)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(
                channel.close(grace=DROPPED_CHANNEL_GRACE_S)
            )
            self._closing[task] = channel
            task.add_done_callback(lambda done: self._closing.pop(done, None))

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, {}, {}
        closing, self._closing = self._closing, {}
        for task in closing:
            task.cancel()
        for channel in [*channels.values(), *closing.values()]:
            await channel.close()

    async def prefill(
        self, at: Endpoint, kv_id: str, prompt: Sequence[int], lease_s: float = 0.0
    ) -> Prefilled:
        request = worker_pb2.PrefillRequest(
            request_id=kv_id, prompt_token_ids=list(prompt), lease_s=lease_s
        )
        try:
            reply = await self._stub(at.address).Prefill(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        return Prefilled(reply.first_token_id, reply.kv_bytes, reply.prefill_s)

    async def extend(self, at: Endpoint, kv_id: str, tokens: Sequence[int]) -> int:
        request = worker_pb2.ExtendRequest(request_id=kv_id, token_ids=list(tokens))
        try:
            reply = await self._stub(at.address).Extend(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        return reply.next_token_id

    async def pull_kv(
        self,
        at: Endpoint,
        kv_id: str,
        source: Endpoint,
        token_start: int,
        token_end: int,
        prompt_tokens: int,
        prefix_token_ids: Sequence[int] = (),
        pacing_bps: float = 0.0,
    ) -> Pulled:
        request = worker_pb2.PullKvRequest(
            request_id=kv_id,
            source_instance_id=source.instance_id,
            source_address=source.address,
            token_start=token_start,
            token_end=token_end,
            prompt_tokens=prompt_tokens,
            prefix_token_ids=list(prefix_token_ids),
            pacing_bps=pacing_bps,
        )
        try:
            reply = await self._stub(at.address).PullKv(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        return Pulled(
            reply.transferred_kv_bytes, reply.transfer_s, reply.total_s, reply.recomputed_tokens
        )

    async def decode(
        self,
        at: Endpoint,
        kv_id: str,
        generated: Sequence[int],
        max_new_tokens: int,
        release_when_done: bool,
    ) -> AsyncIterator[tuple[int, int]]:
        """(index, token_id) pairs as the worker streams them."""
        request = worker_pb2.DecodeRequest(
            request_id=kv_id,
            generated_token_ids=list(generated),
            max_new_tokens=max_new_tokens,
            release_when_done=release_when_done,
        )
        call = self._stub(at.address).Decode(request)
        try:
            async for message in call:
                yield message.index, message.token_id
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        finally:
            call.cancel()

    async def release_kv(self, at: Endpoint, kv_id: str, timeout_s: float | None = None) -> bool:
        request = worker_pb2.ReleaseKvRequest(request_id=kv_id)
        try:
            reply = await self._stub(at.address).ReleaseKv(
                request, timeout=timeout_s or self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        return reply.released

    async def is_alive(self, at: Endpoint, timeout_s: float) -> bool:
        """Whether the worker answers GetWorkerStats within `timeout_s`."""
        try:
            await self._stub(at.address).GetWorkerStats(
                worker_pb2.GetWorkerStatsRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            self._failed(exc, at)
            return False
        return True


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

    async def renew_slot(self, lease_id: str) -> int:
        """Extends a lease; returns its new expiry (unix ms)."""
        lease = await self.client.renew_slot(lease_id)
        return lease.expires_unix_ms

    async def release_slot(self, lease_id: str) -> bool:
        return await self.client.release_slot(lease_id)


def option_from_pb(option: scheduler_pb2.OptionCost) -> OptionCost:
    return OptionCost(
        action=ACTION_FROM_PB[option.action],
        target_id=option.target_instance_id,
        source_id=option.source_instance_id,
        cost_s=option.cost_s,
        wait_s=option.wait_s,
        transfer_s=option.transfer_s,
        compute_s=option.compute_s,
        split_tokens=option.split_tokens,
        feasible=option.feasible,
        infeasible_reason=option.infeasible_reason,
    )


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
    )
