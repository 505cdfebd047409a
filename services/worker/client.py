"""Async client of the worker service: prefill, extend, KV pulls, decode streams.

Failed calls raise the `kvrs.errors` exception matching their status code
(`kvrs.rpc.error_from_rpc`: UNAVAILABLE -> Unavailable, ...), with a message naming the
instance.

Worker calls are never retried here: a worker that does not answer is a failed
instance, and its caller recovers from it (retrying would only delay the recovery). A
channel whose call failed with UNAVAILABLE is dropped, so a worker restarted at the same
address is dialled afresh instead of after gRPC's reconnect backoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs import errors
from kvrs.rpc import error_from_rpc
from kvrs.sampling import Sampling
from kvrs.v1 import worker_pb2, worker_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.common.core_pb import sampling_to_pb

__all__ = ["Endpoint", "Extended", "Prefilled", "Pulled", "WorkerPool"]


@dataclass(frozen=True)
class Endpoint:
    """Where an instance's WorkerService answers."""

    instance_id: str
    address: str


@dataclass(frozen=True)
class Prefilled:
    first_token_id: int
    kv_bytes: int
    prefill_s: float
    queued_s: float = 0.0
    """Time the prefill waited for the worker's compute thread."""
    prefix_hit_tokens: int = 0
    """Prompt tokens taken from the worker's resident prefix blocks."""


@dataclass(frozen=True)
class Extended:
    next_token_id: int
    extend_s: float
    """The extend's forward pass alone (its wait for the compute thread excluded)."""


@dataclass(frozen=True)
class Pulled:
    kv_bytes: int
    transfer_s: float
    total_s: float
    recomputed_tokens: int
    recompute_s: float = 0.0
    """HYBRID: the prefix recompute, overlapped with the transfer."""


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
        self,
        at: Endpoint,
        kv_id: str,
        prompt: Sequence[int],
        lease_s: float = 0.0,
        sampling: Sampling | None = None,
        prompt_tokens: int = 0,
    ) -> Prefilled:
        request = worker_pb2.PrefillRequest(
            request_id=kv_id,
            prompt_token_ids=list(prompt),
            lease_s=lease_s,
            sampling=sampling_to_pb(sampling) if sampling is not None else None,
            prompt_tokens=prompt_tokens,
        )
        try:
            reply = await self._stub(at.address).Prefill(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        return Prefilled(
            reply.first_token_id,
            reply.kv_bytes,
            reply.prefill_s,
            reply.queued_s,
            reply.prefix_hit_tokens,
        )

    async def extend(
        self, at: Endpoint, kv_id: str, tokens: Sequence[int], sampling: Sampling | None = None
    ) -> Extended:
        request = worker_pb2.ExtendRequest(
            request_id=kv_id,
            token_ids=list(tokens),
            sampling=sampling_to_pb(sampling) if sampling is not None else None,
        )
        try:
            reply = await self._stub(at.address).Extend(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        return Extended(reply.next_token_id, reply.extend_s)

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
        while_prefilling: bool = False,
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
            while_prefilling=while_prefilling,
        )
        try:
            reply = await self._stub(at.address).PullKv(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc, at) from exc
        return Pulled(
            reply.transferred_kv_bytes,
            reply.transfer_s,
            reply.total_s,
            reply.recomputed_tokens,
            reply.recompute_s,
        )

    async def decode(
        self,
        at: Endpoint,
        kv_id: str,
        generated: Sequence[int],
        max_new_tokens: int,
        release_when_done: bool,
        sampling: Sampling | None = None,
    ) -> AsyncIterator[tuple[int, int, float]]:
        """(index, token_id, step_s) as the worker streams them (step_s: the compute of the
        step that produced the token, 0 for one already known)."""
        request = worker_pb2.DecodeRequest(
            request_id=kv_id,
            generated_token_ids=list(generated),
            max_new_tokens=max_new_tokens,
            release_when_done=release_when_done,
            sampling=sampling_to_pb(sampling) if sampling is not None else None,
        )
        call = self._stub(at.address).Decode(request)
        try:
            async for message in call:
                yield message.index, message.token_id, message.step_s
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
