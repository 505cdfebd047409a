"""Typed async client of the kvrs control plane: scheduler, cost oracle, slot broker, gossip.

    async with KvrsClient.from_env() as kvrs:           # SCHEDULER_ADDRS=a:50053,b:50053
        choice = await kvrs.select_decode("prefill-0", prompt_tokens=4096)
        plan = await kvrs.recover("req-1", failed_instance_id="decode-0",
                                  source_prefill_instance_id="prefill-0",
                                  prompt_tokens=4096, generated_tokens=17)

Every call carries a deadline (`timeout_s`, per attempt). Every RPC exposed here is
idempotent on its request id, and the client fills one in when the caller gives none, so
a call that fails with UNAVAILABLE or DEADLINE_EXCEEDED is retried with the same id: on
the next scheduler address when several are configured (the address that answered
becomes the preferred one), after a short backoff once every address has been tried.
Other failures, and the last retryable one, raise the `kvrs.errors` exception matching
the status code (`kvrs.rpc.error_from_rpc`), with the `grpc.aio.AioRpcError` chained as
its cause.

Unlike the core of `kvrs/`, this module speaks gRPC, through `kvrs.rpc`; it imports nothing
from `services`, so a caller that only wants the client loads no server code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import Message

from kvrs import errors
from kvrs.rpc import (
    DEFAULT_RPC_TIMEOUT_S,
    ConfigError,
    GrpcSettings,
    env_float,
    env_int,
    error_from_rpc,
    open_channel,
)
from kvrs.v1 import (
    common_pb2,
    gossip_pb2,
    gossip_pb2_grpc,
    oracle_pb2,
    oracle_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    slots_pb2,
    slots_pb2_grpc,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from kvrs.prefill import PrefillOption

__all__ = ["KvrsClient", "RETRYABLE_CODES", "parse_addresses"]

log = logging.getLogger(__name__)

RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""Status codes after which an idempotent call is tried again (elsewhere when possible)."""

_ROLES = {
    "": common_pb2.ROLE_UNSPECIFIED,
    "prefill": common_pb2.ROLE_PREFILL,
    "decode": common_pb2.ROLE_DECODE,
}

Response = TypeVar("Response", bound=Message)


def parse_addresses(value: str, name: str) -> tuple[str, ...]:
    """`host:port` entries of a comma-separated list; ConfigError naming `name` when empty."""
    addresses = tuple(part.strip() for part in value.split(",") if part.strip())
    if not addresses:
        raise ConfigError(f"{name} must list at least one host:port")
    for address in addresses:
        if ":" not in address:
            raise ConfigError(f"{name}: {address!r} is not host:port")
    return addresses


def _request_id(given: str) -> str:
    return given or uuid.uuid4().hex


class _Endpoints:
    """Channels to the replicas of one service, opened lazily, tried from the preferred one."""

    def __init__(
        self,
        service: str,
        addresses: Sequence[str],
        stub_factory: Callable[[grpc.aio.Channel], Any],
        settings: GrpcSettings,
        provider: TracerProvider | None,
    ) -> None:
        self.service = service
        self.addresses = tuple(addresses)
        self._stub_factory = stub_factory
        self._settings = settings
        self._provider = provider
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Any] = {}
        self.preferred = 0
        """Index of the address tried first: the last one that answered."""

    def order(self) -> list[int]:
        count = len(self.addresses)
        return [(self.preferred + step) % count for step in range(count)]

    def stub(self, index: int) -> Any:
        address = self.addresses[index]
        if address not in self._stubs:
            # Retries are this client's own (across replicas), so the channel adds none.
            channel = open_channel(address, self._settings, self._provider)
            self._channels[address] = channel
            self._stubs[address] = self._stub_factory(channel)
        return self._stubs[address]

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            await channel.close()


class KvrsClient:
    """One client for the control plane's services; close it (or use `async with`)."""

    def __init__(
        self,
        scheduler_addrs: Sequence[str] | str = (),
        *,
        cost_oracle_addr: str = "",
        slot_broker_addr: str = "",
        gossip_addr: str = "",
        settings: GrpcSettings | None = None,
        provider: TracerProvider | None = None,
        timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        max_attempts: int = 4,
        backoff_s: float = 0.05,
    ) -> None:
        """Addresses are host:port; `scheduler_addrs` may name several replicas (a list or
        "a:50053,b:50053"). A service left empty raises FailedPrecondition when called.

        `timeout_s` bounds each attempt; `max_attempts` counts attempts over all replicas
        together (at least one per replica is made); `backoff_s` is the pause after every
        replica failed once, doubled each further round.
        """
        if isinstance(scheduler_addrs, str):
            scheduler_addrs = (
                parse_addresses(scheduler_addrs, "scheduler_addrs") if scheduler_addrs else ()
            )
        if timeout_s <= 0:
            raise errors.InvalidArgument("timeout_s", f"must be > 0, got {timeout_s}")
        if max_attempts < 1:
            raise errors.InvalidArgument("max_attempts", f"must be >= 1, got {max_attempts}")
        settings = settings or GrpcSettings()
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self._scheduler = _Endpoints(
            "scheduler",
            scheduler_addrs,
            scheduler_pb2_grpc.SchedulerServiceStub,
            settings,
            provider,
        )
        self._oracle = _Endpoints(
            "cost oracle",
            (cost_oracle_addr,) if cost_oracle_addr else (),
            oracle_pb2_grpc.CostOracleServiceStub,
            settings,
            provider,
        )
        self._slots = _Endpoints(
            "slot broker",
            (slot_broker_addr,) if slot_broker_addr else (),
            slots_pb2_grpc.SlotBrokerServiceStub,
            settings,
            provider,
        )
        self._gossip = _Endpoints(
            "gossip",
            (gossip_addr,) if gossip_addr else (),
            gossip_pb2_grpc.GossipServiceStub,
            settings,
            provider,
        )

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, provider: TracerProvider | None = None
    ) -> KvrsClient:
        """Addresses from SCHEDULER_ADDRS (comma-separated; SCHEDULER_ADDR also accepted),
        COST_ORACLE_ADDR, SLOT_BROKER_ADDR and GOSSIP_ADDR; TLS from KVRS_TLS_*; the
        per-attempt deadline from KVRS_CLIENT_TIMEOUT_S and attempts from
        KVRS_CLIENT_MAX_ATTEMPTS."""
        source = os.environ if env is None else env
        schedulers = source.get("SCHEDULER_ADDRS") or source.get("SCHEDULER_ADDR") or ""
        return cls(
            parse_addresses(schedulers, "SCHEDULER_ADDRS") if schedulers else (),
            cost_oracle_addr=source.get("COST_ORACLE_ADDR", ""),
            slot_broker_addr=source.get("SLOT_BROKER_ADDR", ""),
            gossip_addr=source.get("GOSSIP_ADDR", ""),
            settings=GrpcSettings.from_env(source),
            provider=provider,
            timeout_s=env_float("KVRS_CLIENT_TIMEOUT_S", DEFAULT_RPC_TIMEOUT_S, source),
            max_attempts=env_int("KVRS_CLIENT_MAX_ATTEMPTS", 4, source),
        )

    @property
    def scheduler_addrs(self) -> tuple[str, ...]:
        return self._scheduler.addresses

    @property
    def preferred_scheduler(self) -> str:
        """The scheduler replica tried first by the next call (the last one that answered)."""
        if not self._scheduler.addresses:
            return ""
        return self._scheduler.addresses[self._scheduler.preferred]

    async def close(self) -> None:
        """Closes every channel; safe to call twice."""
        for endpoints in (self._scheduler, self._oracle, self._slots, self._gossip):
            await endpoints.close()

    async def __aenter__(self) -> KvrsClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(
        self,
        endpoints: _Endpoints,
        method: str,
        request: Message,
        timeout_s: float | None,
    ) -> Any:
        if not endpoints.addresses:
            raise errors.FailedPrecondition(f"no {endpoints.service} address configured")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = max(self.max_attempts, len(endpoints.addresses))
        order = endpoints.order()
        backoff_s = self.backoff_s
        last: tuple[grpc.aio.AioRpcError, str] | None = None
        for attempt in range(attempts):
            if attempt and attempt % len(order) == 0:
                await asyncio.sleep(backoff_s)
                backoff_s *= 2
            index = order[attempt % len(order)]
            address = endpoints.addresses[index]
            try:
                response = await getattr(endpoints.stub(index), method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE_CODES:
                    raise error_from_rpc(exc, address) from exc
                log.info(
                    "%s %s at %s failed with %s (attempt %d of %d)",
                    endpoints.service,
                    method,
                    address,
                    exc.code().name,
                    attempt + 1,
                    attempts,
                )
                last = (exc, address)
                continue
            endpoints.preferred = index
            return response
        assert last is not None
        raise error_from_rpc(*last) from last[0]

    # Scheduler

    async def select_decode(
        self,
        prefill_instance_id: str,
        prompt_tokens: int,
        *,
        prefix_hashes: Iterable[int] = (),
        policy: str = "",
        exclude_instance_ids: Iterable[str] = (),
        candidate_instance_ids: Iterable[str] = (),
        request_id: str = "",
        streamed: bool = False,
        prefill_options: Iterable[PrefillOption] = (),
        timeout_s: float | None = None,
    ) -> scheduler_pb2.SelectDecodeResponse:
        """The decode instance for a request prefilled on `prefill_instance_id` (whose KV,
        with `streamed`, moves while it prefills).

        With `prefill_options` (`prefill_instance_id` among them) a policy that chooses
        prefill and decode together may move the prompt to another of them: the reply's
        `prefill_instance_id` says where it prefills."""
        request = scheduler_pb2.SelectDecodeRequest(
            request_id=_request_id(request_id),
            prefill_instance_id=prefill_instance_id,
            prompt_tokens=prompt_tokens,
            prefix_hashes=list(prefix_hashes),
            policy=policy,
            exclude_instance_ids=list(exclude_instance_ids),
            candidate_instance_ids=list(candidate_instance_ids),
            streamed=streamed,
            prefill_options=[
                scheduler_pb2.PrefillOption(
                    instance_id=o.instance_id,
                    finish_s=o.finish_s,
                    prefix_hit_tokens=o.prefix_hit_tokens,
                )
                for o in prefill_options
            ],
        )
        return await self._call(self._scheduler, "SelectDecode", request, timeout_s)

    async def recover(
        self,
        request_id: str,
        *,
        failed_instance_id: str,
        source_prefill_instance_id: str,
        prompt_tokens: int,
        generated_tokens: int,
        deadline_unix_ms: int = 0,
        policy: str = "",
        source_kv_lost: bool = False,
        exclude_instance_ids: Iterable[str] = (),
        skip_slot: bool = False,
        prefix_hashes: Iterable[int] = (),
        timeout_s: float | None = None,
    ) -> scheduler_pb2.RecoverResponse:
        """How request `request_id`, stranded on `failed_instance_id`, continues.

        `request_id` is required: the migration slot the decision may hold is keyed by it,
        which is what makes a retry safe.
        """
        if not request_id:
            raise errors.InvalidArgument("request_id", "must not be empty")
        request = scheduler_pb2.RecoverRequest(
            request_id=request_id,
            failed_instance_id=failed_instance_id,
            source_prefill_instance_id=source_prefill_instance_id,
            prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens,
            deadline_unix_ms=deadline_unix_ms,
            policy=policy,
            source_kv_lost=source_kv_lost,
            exclude_instance_ids=list(exclude_instance_ids),
            skip_slot=skip_slot,
            prefix_hashes=list(prefix_hashes),
        )
        return await self._call(self._scheduler, "Recover", request, timeout_s)

    async def recover_batch(
        self,
        failed_instance_id: str,
        items: Iterable[scheduler_pb2.RecoverItem],
        *,
        policy: str = "",
        skip_slot: bool = False,
        batch_id: str = "",
        timeout_s: float | None = None,
    ) -> scheduler_pb2.RecoverBatchResponse:
        """Plans every request of a failed instance together (they share link bandwidth)."""
        request = scheduler_pb2.RecoverBatchRequest(
            batch_id=_request_id(batch_id),
            failed_instance_id=failed_instance_id,
            items=list(items),
            policy=policy,
            skip_slot=skip_slot,
        )
        return await self._call(self._scheduler, "RecoverBatch", request, timeout_s)

    async def report_outcome(
        self, outcome: scheduler_pb2.DecisionOutcome, *, timeout_s: float | None = None
    ) -> scheduler_pb2.ReportOutcomeResponse:
        """Reports what an executed decision measured (stored where every replica reads it)."""
        request = scheduler_pb2.ReportOutcomeRequest(outcome=outcome)
        return await self._call(self._scheduler, "ReportOutcome", request, timeout_s)

    async def get_corrections(
        self, *, timeout_s: float | None = None
    ) -> scheduler_pb2.GetCorrectionsResponse:
        """The corrections decisions are priced with, and the prediction error per term."""
        request = scheduler_pb2.GetCorrectionsRequest()
        return await self._call(self._scheduler, "GetCorrections", request, timeout_s)

    # Cost oracle

    async def estimate_transfer(
        self,
        src_instance_id: str,
        dst_instance_id: str,
        *,
        kv_bytes: int = 0,
        tokens: int = 0,
        timeout_s: float | None = None,
    ) -> common_pb2.TransferEstimate:
        """T_x(src, dst) for `kv_bytes`, or for `tokens` of the served model."""
        request = oracle_pb2.EstimateTransferRequest(
            src_instance_id=src_instance_id,
            dst_instance_id=dst_instance_id,
            kv_bytes=kv_bytes,
            tokens=tokens,
        )
        reply = await self._call(self._oracle, "EstimateTransfer", request, timeout_s)
        return reply.estimate

    async def get_cost_matrix(
        self,
        *,
        prefill_instance_ids: Iterable[str] = (),
        decode_instance_ids: Iterable[str] = (),
        kv_bytes: int = 0,
        tokens: int = 0,
        timeout_s: float | None = None,
    ) -> oracle_pb2.GetCostMatrixResponse:
        """Transfer estimates for every prefill × decode pair (empty lists: all instances)."""
        request = oracle_pb2.GetCostMatrixRequest(
            prefill_instance_ids=list(prefill_instance_ids),
            decode_instance_ids=list(decode_instance_ids),
            kv_bytes=kv_bytes,
            tokens=tokens,
        )
        return await self._call(self._oracle, "GetCostMatrix", request, timeout_s)

    async def estimate_compute(
        self, new_tokens: int, *, cached_tokens: int = 0, timeout_s: float | None = None
    ) -> oracle_pb2.EstimateComputeResponse:
        """T_pf(new_tokens) when `cached_tokens` is 0, else T_ext(cached_tokens, new_tokens)."""
        request = oracle_pb2.EstimateComputeRequest(
            cached_tokens=cached_tokens, new_tokens=new_tokens
        )
        return await self._call(self._oracle, "EstimateCompute", request, timeout_s)

    # Slot broker

    async def reserve_slot(
        self,
        request_id: str,
        *,
        holder_id: str,
        src_instance_id: str = "",
        dst_instance_id: str = "",
        ttl_s: float = 0.0,
        timeout_s: float | None = None,
    ) -> slots_pb2.ReserveSlotResponse:
        """A migration lease; ResourceExhausted when a cap is reached. Idempotent on id."""
        if not request_id:
            raise errors.InvalidArgument("request_id", "must not be empty")
        request = slots_pb2.ReserveSlotRequest(
            request_id=request_id,
            holder_id=holder_id,
            src_instance_id=src_instance_id,
            dst_instance_id=dst_instance_id,
            ttl_s=ttl_s,
        )
        return await self._call(self._slots, "ReserveSlot", request, timeout_s)

    async def renew_slot(
        self, lease_id: str, *, ttl_s: float = 0.0, timeout_s: float | None = None
    ) -> slots_pb2.SlotLease:
        """Extends a lease; NotFound when it already expired or was released."""
        request = slots_pb2.RenewSlotRequest(lease_id=lease_id, ttl_s=ttl_s)
        reply = await self._call(self._slots, "RenewSlot", request, timeout_s)
        return reply.lease

    async def release_slot(self, lease_id: str, *, timeout_s: float | None = None) -> bool:
        """Returns a lease's slot; False when it had already expired or been released."""
        request = slots_pb2.ReleaseSlotRequest(lease_id=lease_id)
        reply = await self._call(self._slots, "ReleaseSlot", request, timeout_s)
        return reply.released

    async def get_slot_stats(
        self, *, timeout_s: float | None = None
    ) -> slots_pb2.GetSlotStatsResponse:
        """Slots in use, caps, per-link usage and the broker's counters."""
        return await self._call(
            self._slots, "GetSlotStats", slots_pb2.GetSlotStatsRequest(), timeout_s
        )

    # Gossip (reads)

    async def list_nodes(
        self, role: str = "", *, include_down: bool = False, timeout_s: float | None = None
    ) -> gossip_pb2.ListNodesResponse:
        """Registered instances ("prefill", "decode" or "" for all), each with its age."""
        if role not in _ROLES:
            raise errors.InvalidArgument("role", f"must be 'prefill', 'decode' or '', got {role!r}")
        request = gossip_pb2.ListNodesRequest(role=_ROLES[role], include_down=include_down)
        return await self._call(self._gossip, "ListNodes", request, timeout_s)

    async def list_links(self, *, timeout_s: float | None = None) -> gossip_pb2.ListLinksResponse:
        """The newest bandwidth sample of every measured link, each with its age."""
        return await self._call(self._gossip, "ListLinks", gossip_pb2.ListLinksRequest(), timeout_s)
