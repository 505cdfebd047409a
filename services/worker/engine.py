"""What a worker does, without gRPC: prefill, decode, extend, and moving KV in and out.

The servicer translates protobuf to these calls and back. Forward passes go to the
compute thread, transfers to libkvxfer's threads; the event loop only keeps the books.
Reaching another worker (the SendKv a pull needs) is a callable passed in, so nothing
here speaks gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch
from opentelemetry import trace

from kvrs.errors import FailedPrecondition, InvalidArgument, KvrsError, NotFound
from kvrs.sampling import Sampling
from kvrs.tokenizer import validate_token_ids
from libkvxfer import (
    PROTOCOL_VERSION,
    KvLayout,
    KvPage,
    PeerLost,
    ProtocolVersionMismatch,
    TransferAgent,
    TransferRejected,
    TransferTicket,
)
from services.worker.compute import ComputeQueue, Job
from services.worker.kvstore import KvStore, Resident
from services.worker.model import Transformer
from services.worker.paged_kv import FillProgress
from services.worker.sampling import choose

log = logging.getLogger(__name__)

_MAX_REQUEST_ID_CHARS = 256
_MAX_INSTANCE_ID_CHARS = 256
_MAX_ADDRESS_CHARS = 512
MAX_LEASE_S = 86_400.0
"""Longest KV lease a request may ask for (a day); an unbounded one overflows expiries."""
MIN_PACING_BPS = 1e6
"""Slowest pacing a transfer may ask for: below it a sender would sleep for ages."""
_REJECTION_GRACE_S = 2.0
"""After a failed SendKv, how long the pending receive may take to see the rejection."""


@dataclass(frozen=True)
class SendResult:
    """What the source reports after pushing a range (SendKvResponse)."""

    kv_bytes: int
    transfer_s: float
    token_ids: list[int]


SendKvCall = Callable[[str, TransferTicket, float, float, bool], Awaitable[SendResult]]
"""(source_address, ticket, pacing_bps, deadline_s, while_prefilling) -> the source's
SendKv answer."""


@dataclass(frozen=True)
class _Source:
    """Where a pull's KV comes from, and how it is asked for."""

    instance_id: str
    address: str
    pacing_bps: float
    traceparent: str
    deadline_s: float | None
    while_prefilling: bool
    """Layer-wise streaming: the source may still be prefilling the request."""


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    prompt_tokens: int
    kv_bytes: int
    prefill_s: float
    queued_s: float
    lease_expires_unix_ms: int
    prefix_hit_tokens: int = 0
    """Leading prompt tokens whose KV came from resident prefix blocks, not computed."""


@dataclass(frozen=True)
class DecodedToken:
    token_id: int
    index: int
    step_s: float
    last: bool


@dataclass(frozen=True)
class ExtendResult:
    next_token_id: int
    resident_tokens: int
    extend_s: float
    kv_bytes: int


@dataclass(frozen=True)
class PullResult:
    resident_tokens: int
    transferred_kv_bytes: int
    transfer_s: float
    transfer_bps: float
    recomputed_tokens: int
    recompute_s: float
    total_s: float
    transfer_id: str


@dataclass(frozen=True)
class WorkerStats:
    resident_requests: int
    block_tokens: int
    kv_capacity_blocks: int
    free_kv_blocks: int
    used_kv_bytes: int
    kv_capacity_bytes: int
    queued_work_s: float
    compute_factor: float
    """Measured / profile seconds of the recent forward passes (`services.worker.pace`)."""
    queue_depth: int
    running_requests: int
    running_context_tokens: int
    """Tokens cached by the running decode streams, summed: what each step reads."""
    evicted_requests: int
    expired_requests: int
    resident_prefix_hashes: list[int]


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id", "must not be empty")
    if len(request_id) > _MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"longer than {_MAX_REQUEST_ID_CHARS} characters")


def _choose(entry: Resident, logits: torch.Tensor) -> int:
    """The token after the resident positions: generated token (resident - prompt)."""
    return choose(logits, entry.sampling, entry.resident_tokens - entry.prompt_tokens)


class WorkerEngine:
    """One worker's requests, model, KV memory and transfer agent."""

    def __init__(
        self,
        instance_id: str,
        model_name: str,
        model: Transformer,
        store: KvStore,
        compute: ComputeQueue,
        agent: TransferAgent,
        send_kv: SendKvCall,
        lease_s: float,
        send_kv_deadline_s: float,
        pacing_bps: float = 0.0,
    ) -> None:
        self.instance_id = instance_id
        self.model_name = model_name
        self.model = model
        self.store = store
        self.compute = compute
        self.agent = agent
        self._send_kv = send_kv
        self._lease_s = lease_s
        self._send_kv_deadline_s = send_kv_deadline_s
        self._pacing_bps = pacing_bps
        self._decoding: list[Resident] = []
        """The requests whose Decode stream is open (one entry per stream)."""
        config = model.config
        self.layout = KvLayout(config.layers, config.kv_heads, config.head_dim, model.dtype)

    # -- helpers ----------------------------------------------------------------------

    def _tokens(self, token_ids: Sequence[int], field: str, allow_empty: bool = False) -> list[int]:
        ids = list(token_ids)
        if not ids and not allow_empty:
            raise InvalidArgument(field, "must not be empty")
        validate_token_ids(ids, field, self.model.config.vocab_size)
        return ids

    def _lease(self, lease_s: float) -> float:
        if not 0 <= lease_s <= MAX_LEASE_S:  # NaN fails too
            raise InvalidArgument("lease_s", f"must be in [0, {MAX_LEASE_S:.0f}] s, got {lease_s}")
        return lease_s or self._lease_s

    def _check_positions(self, tokens: int, field: str) -> None:
        if tokens > self.model.config.max_positions:
            raise InvalidArgument(
                field, f"{tokens} positions exceed the model's {self.model.config.max_positions}"
            )

    @contextlib.asynccontextmanager
    async def _using(self, entry: Resident):
        """Hold `entry` (serialised per request, pinned against eviction)."""
        async with entry.lock:
            if self.store.find(entry.request_id) is not entry:
                raise NotFound(
                    f"request {entry.request_id!r} was released while waiting", field="request_id"
                )
            self.store.pin(entry)
            try:
                yield entry
            finally:
                self.store.unpin(entry)

    async def _extend(self, entry: Resident, token_ids: list[int]) -> tuple[int, float]:
        """Append KV for `token_ids` (compute thread); the next token and its time."""
        cached = entry.resident_tokens
        self._check_positions(cached + len(token_ids), "token_ids")
        self.store.grow(entry, cached + len(token_ids))
        try:
            timed = await self.compute.forward(entry.cache, token_ids)
        except BaseException:
            # Cancelled after the pass ran: forget its KV, as if it had not run.
            entry.cache.truncate(min(entry.cache.length, cached))
            raise
        entry.token_ids.extend(token_ids)
        entry.next_token_id = _choose(entry, timed.value)
        return entry.next_token_id, timed.compute_s

    # -- prefill, decode, extend ----------------------------------------------------

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        lease_s: float = 0.0,
        sampling: Sampling | None = None,
        prompt_tokens: int = 0,
    ) -> PrefillResult:
        """KV of the prompt (kept resident) and the token drawn after it.

        `prompt_tokens` < len(prompt) says the prompt ends with generated tokens (a
        RECOMPUTE): the token drawn is then generated token len(prompt) - prompt_tokens.
        """
        _check_request_id(request_id)
        prompt = self._tokens(prompt_token_ids, "prompt_token_ids")
        self._check_positions(len(prompt), "prompt_token_ids")
        if not 0 <= prompt_tokens <= len(prompt):
            raise InvalidArgument(
                "prompt_tokens", f"must be in [0, {len(prompt)}], got {prompt_tokens}"
            )
        prompt_tokens = prompt_tokens or len(prompt)
        lease = self._lease(lease_s)
        existing = self.store.find(request_id)
        if existing is not None:
            async with self._using(existing):
                if (
                    existing.first_token_id is None
                    or existing.token_ids[: len(prompt)] != prompt
                    or existing.prompt_tokens != prompt_tokens
                ):
                    raise FailedPrecondition(
                        f"request {request_id!r} is already resident here "
                        "with other tokens; ReleaseKv it first",
                        field="request_id",
                    )
                return self._prefill_result(existing, 0.0, 0.0)
        # Resident prefix blocks are shared, not computed; at least the last token is
        # computed, since its logits give the first generated token.
        block = self.store.block_tokens
        shared = self.store.reusable_prefix(prompt, (len(prompt) - 1) // block * block)
        entry = self.store.add(
            request_id, len(prompt), lease, prompt_tokens=prompt_tokens, shared=shared
        )
        entry.sampling = sampling or Sampling()
        entry.token_ids = prompt
        hit = entry.prefix_hit_tokens
        # A pull sent with this prefill streams each layer as soon as it is computed.
        filling = entry.cache.filling = FillProgress(self.model.config.layers, hit, len(prompt))
        try:
            async with entry.lock:
                timed = await self.compute.forward(entry.cache, prompt[hit:])
                entry.first_token_id = entry.next_token_id = _choose(entry, timed.value)
                filling.finish()
                self.store.publish(entry)
        except BaseException as exc:
            filling.fail(repr(exc))
            self.store.discard(entry)
            raise
        finally:
            entry.cache.filling = None
            self.store.unpin(entry)
        trace.get_current_span().set_attributes(
            {
                "kvrs.request_id": request_id,
                "kvrs.prompt_tokens": len(prompt),
                "kvrs.prefix_hit_tokens": hit,
            }
        )
        return self._prefill_result(entry, timed.compute_s, timed.queued_s)

    def _prefill_result(self, entry: Resident, prefill_s: float, queued_s: float) -> PrefillResult:
        expires_unix_ms = int((time.time() + entry.lease_s) * 1000)
        assert entry.first_token_id is not None, "a prefilled entry has its first token"
        return PrefillResult(
            first_token_id=entry.first_token_id,
            prompt_tokens=entry.prompt_tokens,
            kv_bytes=entry.cache.resident_bytes(),
            prefill_s=prefill_s,
            queued_s=queued_s,
            lease_expires_unix_ms=expires_unix_ms,
            prefix_hit_tokens=entry.prefix_hit_tokens,
        )

    async def decode(
        self,
        request_id: str,
        generated_token_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_id: int | None = None,
        release_when_done: bool = False,
        sampling: Sampling | None = None,
    ) -> AsyncIterator[DecodedToken]:
        """Tokens after `generated_token_ids` (see DecodeRequest in worker.proto)."""
        _check_request_id(request_id)
        generated = self._tokens(generated_token_ids, "generated_token_ids", allow_empty=True)
        if max_new_tokens <= 0:
            raise InvalidArgument("max_new_tokens", f"must be > 0, got {max_new_tokens}")
        entry = self.store.get(request_id)
        self._decoding.append(entry)
        try:
            async with self._using(entry):
                if sampling is not None:
                    entry.sampling = sampling
                token, step_s = await self._catch_up(entry, generated)
                index = len(generated)
                for produced in range(max_new_tokens):
                    if produced == max_new_tokens - 1 or token == stop_token_id:
                        break
                    # The next step is queued before this token is handed out, so the
                    # stream is in the compute loop's next pass, batched with the others,
                    # whatever its reader does meanwhile.
                    step = self._start_step(entry, token)
                    try:
                        yield DecodedToken(token, index + produced, step_s, last=False)
                    except BaseException:
                        if isinstance(step, Job):
                            await self._abandon_step(entry, step)
                        raise
                    token, step_s = await self._finish_step(entry, token, step)
                if release_when_done:
                    # Pinned: it goes as `_using` unpins it, before the last token leaves.
                    # A reader holding the last token may close the stream at once; the
                    # request's KV is gone by then, not a moment later or never.
                    self.store.release(request_id)
        finally:
            self._decoding.remove(entry)
        yield DecodedToken(token, index + produced, step_s, last=True)

    async def _catch_up(self, entry: Resident, generated: list[int]) -> tuple[int, float]:
        """Feed generated tokens whose KV is not resident; the next token to emit."""
        resident_generated = entry.resident_tokens - entry.prompt_tokens
        if resident_generated < 0:
            raise FailedPrecondition(
                f"only {entry.resident_tokens} of the {entry.prompt_tokens} "
                "prompt tokens are resident",
                field="request_id",
            )
        known = entry.token_ids[entry.prompt_tokens : entry.resident_tokens]
        if resident_generated > len(generated):
            if not generated or known[: len(generated)] != generated:
                raise FailedPrecondition(
                    f"{resident_generated} generated tokens are resident but "
                    f"only {len(generated)} were given",
                    field="generated_token_ids",
                )
            # The KV ran ahead of this reader (a stream computes a step before its token
            # is read): drop back behind its last token, which is fed again below.
            end = entry.prompt_tokens + len(generated) - 1
            entry.cache.truncate(end)
            del entry.token_ids[end:]
            resident_generated = len(generated) - 1
            known = known[:resident_generated]
        if len(known) == resident_generated and known != generated[:resident_generated]:
            first = next(
                i for i, (a, b) in enumerate(zip(known, generated, strict=False)) if a != b
            )
            raise FailedPrecondition(
                f"generated token {first} differs from the resident KV's",
                field="generated_token_ids",
            )
        missing = generated[resident_generated:]
        if missing:
            return await self._extend(entry, missing)
        if entry.next_token_id is None:
            raise FailedPrecondition(
                "the KV came from another worker: pass at least the first generated token",
                field="generated_token_ids",
            )
        return entry.next_token_id, 0.0

    def _start_step(self, entry: Resident, token: int) -> Job | KvrsError:
        """Queue feeding `token` (its KV appended); the job, or why it cannot run (raised
        once the token before it was handed out)."""
        context = entry.resident_tokens
        try:
            self._check_positions(context + 1, "max_new_tokens")
            self.store.grow(entry, context + 1)
            return self.compute.submit(entry.cache, [token])
        except KvrsError as exc:
            return exc

    async def _finish_step(
        self, entry: Resident, token: int, step: Job | KvrsError
    ) -> tuple[int, float]:
        if isinstance(step, KvrsError):
            raise step
        context = entry.resident_tokens
        try:
            timed = await self.compute.wait(step)
        except BaseException:
            entry.cache.truncate(min(entry.cache.length, context))
            raise
        entry.token_ids.append(token)
        entry.next_token_id = _choose(entry, timed.value)
        self.store.touch(entry)
        return entry.next_token_id, timed.compute_s

    async def _abandon_step(self, entry: Resident, step: Job) -> None:
        """The reader left: the queued step never happened (its KV is forgotten if the
        pass already ran), so the resident KV ends at the last token handed out."""
        await asyncio.shield(self.compute.withdraw(step))
        if step.finished:
            entry.cache.truncate(entry.cache.length - 1)

    async def extend(
        self, request_id: str, token_ids: Sequence[int], sampling: Sampling | None = None
    ) -> ExtendResult:
        """Append `token_ids` on top of the resident KV; the token drawn after them."""
        _check_request_id(request_id)
        tokens = self._tokens(token_ids, "token_ids")
        entry = self.store.get(request_id)
        async with self._using(entry):
            if sampling is not None:
                entry.sampling = sampling
            next_token, extend_s = await self._extend(entry, tokens)
            return ExtendResult(
                next_token_id=next_token,
                resident_tokens=entry.resident_tokens,
                extend_s=extend_s,
                kv_bytes=entry.cache.resident_bytes(),
            )

    # -- moving KV --------------------------------------------------------------------

    async def pull_kv(
        self,
        request_id: str,
        source_instance_id: str,
        source_address: str,
        token_start: int,
        token_end: int,
        prompt_tokens: int = 0,
        prefix_token_ids: Sequence[int] = (),
        lease_s: float = 0.0,
        pacing_bps: float = 0.0,
        traceparent: str = "",
        deadline_s: float | None = None,
        while_prefilling: bool = False,
    ) -> PullResult:
        """Receive [token_start, token_end) of a request's KV from `source_instance_id`
        (with `while_prefilling`, layer by layer as the source computes it)."""
        _check_request_id(request_id)
        if not source_instance_id:
            raise InvalidArgument("source_instance_id", "must not be empty")
        if len(source_instance_id) > _MAX_INSTANCE_ID_CHARS:
            # It names the transfer pair's keys, which the rendezvous store caps in size.
            raise InvalidArgument(
                "source_instance_id", f"longer than {_MAX_INSTANCE_ID_CHARS} characters"
            )
        if source_instance_id == self.instance_id:
            raise InvalidArgument("source_instance_id", "is this worker itself")
        if not source_address:
            raise InvalidArgument("source_address", "must not be empty")
        if (
            len(source_address) > _MAX_ADDRESS_CHARS
            or not source_address.isascii()
            or not source_address.isprintable()
            or " " in source_address
        ):
            # gRPC cannot even build a channel to such a target.
            raise InvalidArgument(
                "source_address", f"must be host:port, got {source_address[:64]!r}"
            )
        if token_start < 0:
            raise InvalidArgument("token_start", f"must be >= 0, got {token_start}")
        if token_end <= token_start:
            raise InvalidArgument(
                "token_end", f"must be > token_start ({token_start}), got {token_end}"
            )
        self._check_positions(token_end, "token_end")
        if not 0 <= prompt_tokens <= token_end:
            raise InvalidArgument(
                "prompt_tokens", f"must be in [0, token_end], got {prompt_tokens}"
            )
        _require_pacing(pacing_bps)
        prefix = self._tokens(prefix_token_ids, "prefix_token_ids", allow_empty=True)
        if prefix and len(prefix) != token_start:
            raise InvalidArgument(
                "prefix_token_ids",
                f"must hold token_start ({token_start}) tokens, got {len(prefix)}",
            )
        lease = self._lease(lease_s)
        started = time.monotonic()
        source = _Source(
            source_instance_id,
            source_address,
            pacing_bps,
            traceparent,
            deadline_s,
            while_prefilling,
        )
        entry = self.store.find(request_id)
        if entry is not None:
            async with self._using(entry):
                if entry.resident_tokens >= token_end:
                    return PullResult(
                        entry.resident_tokens, 0, 0.0, 0.0, 0, 0.0, time.monotonic() - started, ""
                    )
                if prefix or entry.resident_tokens != token_start:
                    raise FailedPrecondition(
                        f"request {request_id!r} has {entry.resident_tokens} tokens resident "
                        f"here; a pull must start there (token_start) without a prefix",
                        field="token_start",
                    )
                return await self._pull_into(
                    entry, source, [], token_start, token_end, prompt_tokens, started
                )
        if token_start > 0 and not prefix:
            raise FailedPrecondition(
                f"request {request_id!r} has no KV here: start at 0, or "
                "give prefix_token_ids to recompute [0, token_start)",
                field="token_start",
            )
        shared = self.store.reusable_prefix(prefix, len(prefix))
        entry = self.store.add(request_id, token_end, lease, shared=shared)
        try:
            async with entry.lock:
                return await self._pull_into(
                    entry, source, prefix, token_start, token_end, prompt_tokens, started
                )
        except BaseException:
            self.store.discard(entry)
            raise
        finally:
            self.store.unpin(entry)

    async def _pull_into(
        self,
        entry: Resident,
        source: _Source,
        prefix: list[int],
        start: int,
        token_end: int,
        prompt_tokens: int,
        started: float,
    ) -> PullResult:
        self.store.grow(entry, token_end)
        reused = entry.resident_tokens if prefix else 0
        recompute = None
        if reused < len(prefix):
            # The prefix [0, start) comes from the resident prefix blocks the entry shares
            # and is computed past them (HYBRID), while the rest is received into
            # [start, token_end) of the same sequence.
            recompute = asyncio.ensure_future(self.compute.forward(entry.cache, prefix[reused:]))
        try:
            sent, stats = await self._receive(entry, source, start, token_end)
        except BaseException:
            if recompute is not None:
                # The recompute writes into the same blocks: let it finish first.
                with contextlib.suppress(KvrsError):
                    await recompute
            raise
        recompute_s = 0.0 if recompute is None else (await recompute).compute_s
        if len(sent.token_ids) != token_end - start:
            raise FailedPrecondition(
                f"source sent {len(sent.token_ids)} token ids for {token_end - start} positions",
                field="token_end",
            )
        entry.cache.commit(token_end)
        entry.token_ids = [*entry.token_ids, *prefix, *sent.token_ids]
        entry.prompt_tokens = prompt_tokens or token_end
        entry.next_token_id = None
        entry.prefix_hit_tokens = reused
        self.store.touch(entry)
        self.store.publish(entry)
        trace.get_current_span().set_attributes(
            {
                "kvrs.request_id": entry.request_id,
                "kvrs.kv_bytes": stats.kv_bytes,
                "kvrs.source_instance_id": source.instance_id,
                "kvrs.recomputed_tokens": len(prefix) - reused,
                "kvrs.prefix_hit_tokens": reused,
            }
        )
        return PullResult(
            resident_tokens=entry.resident_tokens,
            transferred_kv_bytes=stats.kv_bytes,
            transfer_s=stats.seconds,
            transfer_bps=stats.throughput_bps,
            recomputed_tokens=len(prefix) - reused,
            recompute_s=recompute_s,
            total_s=time.monotonic() - started,
            transfer_id=stats.transfer_id,
        )

    async def _receive(self, entry: Resident, source: _Source, start: int, end: int):
        """One pull attempt, retried once when the pair with the source was stale."""
        for attempt in (1, 2):
            try:
                return await self._receive_once(entry, source, start, end)
            except PeerLost as exc:
                # A source that restarted answers the old pair's ticket with PeerLost; the
                # failed attempt closed that pair, so a second ticket gets a fresh one.
                if attempt == 2:
                    raise
                log.info(
                    "pull of %s from %s: %s; retrying on a new pair",
                    entry.request_id,
                    source.instance_id,
                    exc,
                )
        raise AssertionError("unreachable")

    async def _receive_once(self, entry: Resident, source: _Source, start: int, end: int):
        ticket = self.agent.prepare(
            source.instance_id, entry.request_id, start, end, source.traceparent
        )
        out = _pages(entry, start, end)
        received = asyncio.ensure_future(self.agent.recv_async(ticket, self.layout, out))
        deadline = self._send_kv_deadline_s
        if source.deadline_s is not None:
            deadline = min(source.deadline_s, deadline)
        try:
            sent = await self._send_kv(
                source.address, ticket, source.pacing_bps, deadline, source.while_prefilling
            )
        except KvrsError as send_error:
            error = await self._pull_failure(ticket, received, send_error)
            raise _as_pull_error(error) from send_error
        except BaseException:
            self.agent.abandon(ticket, "pull cancelled")
            with contextlib.suppress(KvrsError):
                await received
            raise
        return sent, (await received).stats

    async def _pull_failure(
        self, ticket: TransferTicket, received: asyncio.Future, send_error: KvrsError
    ) -> KvrsError:
        """The error a failed SendKv stands for, once the pending receive is settled."""
        if send_error.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            # The source's handler ran: it sent its refusal over the pair as well.
            await asyncio.wait({received}, timeout=_REJECTION_GRACE_S)
        if not received.done():
            self.agent.abandon(ticket, f"SendKv failed: {send_error}")
        try:
            await received
        except TransferRejected:
            return send_error
        except KvrsError as recv_error:
            # The receiving side's own finding (checksum, layout...) is the precise one;
            # a pair that broke under a stale ticket is retried as PeerLost.
            if not isinstance(recv_error, PeerLost):
                return recv_error
        if send_error.code == "UNAVAILABLE":
            return PeerLost(str(send_error))
        return send_error

    async def send_kv(
        self, ticket: TransferTicket, pacing_bps: float = 0.0, while_prefilling: bool = False
    ) -> SendResult:
        """Push the ticket's range of a resident request to the receiver it names.

        With `while_prefilling` the request may still be prefilling here, or not have
        arrived yet (its Prefill and the receiver's pull were sent together): the send
        waits for it, then streams each layer's chunks as soon as the prefill has
        computed that layer (layer-wise streaming)."""
        _require_pacing(pacing_bps)
        if ticket.sender_id != self.instance_id:
            # The receiver waits on a pair named after the worker it meant: unreachable.
            raise InvalidArgument(
                "ticket.sender_instance_id",
                f"names {ticket.sender_id!r}, this is {self.instance_id!r}",
            )
        timeout_s = self.agent.config.timeout_s
        try:
            if ticket.protocol_version != PROTOCOL_VERSION:
                raise ProtocolVersionMismatch(PROTOCOL_VERSION, ticket.protocol_version, "ticket")
            _check_request_id(ticket.request_id)
            if while_prefilling:
                await self.store.arrival(ticket.request_id, timeout_s)
            entry = self.store.get(ticket.request_id)
            filling = entry.cache.filling if while_prefilling else None
            sendable = entry.resident_tokens if filling is None else filling.end
            if ticket.token_end > sendable:
                raise InvalidArgument(
                    "token_end",
                    f"{ticket.token_end} is beyond the "
                    f"{sendable} tokens resident on "
                    f"{self.instance_id}",
                )
        except KvrsError as exc:
            await self.agent.reject_async(ticket, exc)
            raise
        ready = None if filling is None else functools.partial(filling.wait, timeout_s=timeout_s)
        self.store.pin(entry)
        try:
            kv = _pages(entry, ticket.token_start, ticket.token_end)
            token_ids = entry.token_ids[ticket.token_start : ticket.token_end]
            stats = await self.agent.send_async(
                ticket, kv, pacing_bps or self._pacing_bps or None, ready
            )
        finally:
            self.store.unpin(entry)
        return SendResult(kv_bytes=stats.kv_bytes, transfer_s=stats.seconds, token_ids=token_ids)

    # -- lifecycle and load -----------------------------------------------------------

    def release(self, request_id: str) -> tuple[bool, int]:
        """(released, bytes freed); releasing an absent request is not an error."""
        _check_request_id(request_id)
        present = self.store.find(request_id) is not None
        return present, self.store.release(request_id)

    def stats(self) -> WorkerStats:
        store = self.store
        return WorkerStats(
            resident_requests=len(store),
            block_tokens=store.block_tokens,
            kv_capacity_blocks=store.capacity_blocks,
            free_kv_blocks=store.free_blocks,
            used_kv_bytes=store.used_bytes,
            kv_capacity_bytes=store.capacity_blocks * store.block_tokens * store.bytes_per_token,
            queued_work_s=self.compute.queued_work_s,
            compute_factor=self.compute.pace.factor if self.compute.pace.measured else 0.0,
            queue_depth=self.compute.depth,
            running_requests=len(self._decoding),
            running_context_tokens=sum(entry.resident_tokens for entry in self._decoding),
            evicted_requests=store.evicted,
            expired_requests=store.expired,
            resident_prefix_hashes=store.prefix_hashes(),
        )

    async def canary(self) -> None:
        """A one-token forward pass: health means the model really runs."""
        await self.compute.forward(self.model.new_cache(), [0])

    async def expire_forever(self, interval_s: float) -> None:
        """Drop expired leases every `interval_s` (freeing memory before it is needed)."""
        while True:
            await asyncio.sleep(interval_s)
            gone = self.store.expire()
            if gone:
                log.info("leases expired: %s", ", ".join(gone))


def _pages(entry: Resident, start: int, end: int) -> list[KvPage]:
    """Positions [start, end) of the entry's KV as the blocks hold them (views, in place)."""
    return [KvPage(s, e, layers) for s, e, layers in entry.cache.pages(start, end)]


def _require_pacing(pacing_bps: float) -> None:
    """0 (the worker's own setting) or a rate a transfer can finish at; NaN is refused."""
    if pacing_bps != 0 and not pacing_bps >= MIN_PACING_BPS:
        raise InvalidArgument(
            "pacing_bps", f"must be 0 or at least {MIN_PACING_BPS:.0f} bit/s, got {pacing_bps}"
        )


_SEND_TO_PULL_FIELDS = {
    "request_id": "request_id",
    "ticket.sender_instance_id": "source_instance_id",
    "ticket.token_start": "token_start",
    "ticket.token_end": "token_end",
    "pacing_bps": "pacing_bps",
}
"""SendKv fields a source may refuse, by the PullKv field they came from."""


def _as_pull_error(error: KvrsError) -> KvrsError:
    """A source's refusal of its SendKv, named after the PullKv field behind it: the
    caller of PullKv never sent a SendKv, so the source's field names are not theirs."""
    if not isinstance(error, InvalidArgument):
        return error
    field = _SEND_TO_PULL_FIELDS.get(error.field, "source_address")
    return InvalidArgument(field, f"the source refused the transfer: {error}")
