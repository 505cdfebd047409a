"""Carrying out a recovery decision: the worker calls behind MIGRATE, RECOMPUTE and HYBRID.

A request with prompt P (L tokens) has produced tokens g_0 .. g_{n-1}; the prompt's KV
lives on its prefill instance. Each action leaves the target with the KV of P plus
every generated token, ready to decode token n:

    MIGRATE    target pulls [0, L) from the prefill instance, then Extend(g_0..g_{n-1})
    HYBRID     target pulls [k, L) while it recomputes [0, k) itself (one PullKv with
               prefix_token_ids), then Extend(g_0..g_{n-1})
    RECOMPUTE  a prefill instance prefills P + g_0..g_{n-2} under a fresh KV id (its
               first token must be g_{n-1}), the target pulls all of it, then
               Extend(g_{n-1})

Any step that fails names the instance that stopped answering in a `StepFailed`, so the
caller can decide again without it (a lost source means RECOMPUTE). The migration slot
the scheduler reserved is renewed while the steps run and released after them.

Each step is timed at the router and by the worker that ran it, which together split
the decision's time into the terms the scheduler predicted (`kvrs.learning.Terms`):
a call's wall time less the worker's compute is its queue wait (and call overhead); a
pull's wall time less its time on the wire is its set-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from opentelemetry.trace import Tracer

from kvrs.errors import InvalidArgument, KvrsError, NotFound
from kvrs.learning import Terms
from kvrs.recovery import Action, kv_tokens_moved
from kvrs.sampling import Sampling
from services.router.records import DETECTED_BY_TRANSFER, Decision, Endpoint, Lost, Run
from services.worker.client import Extended, Prefilled, Pulled

log = logging.getLogger(__name__)

ALIVE_CHECK_TIMEOUT_S = 0.5
"""How long a worker may take to answer GetWorkerStats after one of its calls failed."""


class Workers(Protocol):
    async def prefill(
        self,
        at: Endpoint,
        kv_id: str,
        prompt: Sequence[int],
        lease_s: float = 0.0,
        sampling: Sampling | None = None,
        prompt_tokens: int = 0,
    ) -> Prefilled: ...

    async def extend(
        self, at: Endpoint, kv_id: str, tokens: Sequence[int], sampling: Sampling | None = None
    ) -> Extended: ...

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
    ) -> Pulled: ...

    def decode(
        self,
        at: Endpoint,
        kv_id: str,
        generated: Sequence[int],
        max_new_tokens: int,
        release_when_done: bool,
        sampling: Sampling | None = None,
    ) -> AsyncIterator[tuple[int, int, float]]: ...

    async def release_kv(
        self, at: Endpoint, kv_id: str, timeout_s: float | None = None
    ) -> bool: ...

    async def is_alive(self, at: Endpoint, timeout_s: float) -> bool: ...


class Slots(Protocol):
    async def renew_slot(self, lease_id: str) -> int: ...

    async def release_slot(self, lease_id: str) -> bool: ...


class StepFailed(Exception):
    """A recovery step failed because `lost` stopped answering (or lost the KV)."""

    def __init__(self, lost: Lost) -> None:
        super().__init__(f"{lost.instance_id}: {lost.reason}")
        self.lost = lost


class RecoveryExecutor:
    """Runs the worker steps of one decision (see the module docstring)."""

    def __init__(
        self,
        workers: Workers,
        slots: Slots,
        tracer: Tracer,
        resident_prefix_tokens: Callable[[str, Run], int] = lambda _id, _run: 0,
    ) -> None:
        self.workers = workers
        self.slots = slots
        self.tracer = tracer
        self.resident_prefix_tokens = resident_prefix_tokens
        """(instance id, run) -> leading prompt tokens the instance heartbeats as held."""

    async def execute(self, run: Run, decision: Decision) -> tuple[Terms, int]:
        """Leaves `run.decode` / `run.kv_id` on the target, ready to decode; returns the
        measured terms of the steps (total_s and first_token_s are the caller's) and the
        KV bytes moved.

        Raises StepFailed naming the instance that failed; InvalidArgument passes through.
        """
        async with self._slot(decision):
            if decision.action is Action.RECOMPUTE:
                return await self._recompute(run, decision)
            if decision.action in (Action.MIGRATE, Action.HYBRID):
                return await self._migrate(run, decision)
            raise InvalidArgument("action", f"{decision.action.value} has no steps")

    async def pull(
        self,
        run: Run,
        target: Endpoint,
        kv_id: str,
        source: Endpoint,
        token_start: int,
        token_end: int,
        prompt_tokens: int,
        prefix: Sequence[int] = (),
        while_prefilling: bool = False,
    ) -> Pulled:
        """One PullKv into `target` (streamed, with `while_prefilling`, as the source
        prefills); a failure is pinned on whichever side died."""
        if (target.instance_id, kv_id) in run.held:
            # A stale copy on the target would satisfy the pull without moving anything.
            with contextlib.suppress(KvrsError):
                await self.workers.release_kv(target, kv_id)
        run.hold(target, kv_id)
        with self.tracer.start_as_current_span("router.pull_kv") as span:
            span.set_attributes(
                {
                    "kvrs.request_id": run.request.request_id,
                    "kvrs.transfer.src_instance_id": source.instance_id,
                    "kvrs.transfer.dst_instance_id": target.instance_id,
                    "kvrs.token_start": token_start,
                    "kvrs.token_end": token_end,
                    "kvrs.recomputed_tokens": len(prefix),
                    "kvrs.transfer.streamed": while_prefilling,
                }
            )
            try:
                pulled = await self.workers.pull_kv(
                    target,
                    kv_id,
                    source,
                    token_start,
                    token_end,
                    prompt_tokens,
                    prefix,
                    while_prefilling=while_prefilling,
                )
            except InvalidArgument:
                raise
            except KvrsError as exc:
                raise StepFailed(await self._who_failed(run, target, source, exc)) from exc
            span.set_attributes(
                {
                    "kvrs.transfer.kv_bytes": pulled.kv_bytes,
                    "kvrs.transfer.measured_s": pulled.transfer_s,
                }
            )
            return pulled

    async def _migrate(self, run: Run, decision: Decision) -> tuple[Terms, int]:
        prompt = run.request.prompt
        assert run.prefill is not None
        source = (
            run.prefill
            if decision.source.instance_id == run.prefill.instance_id
            else decision.source
        )
        # PullKv needs at least one token to move; k = L would be a full recompute.
        moved = kv_tokens_moved(
            decision.action, len(prompt), len(run.generated), decision.split_tokens
        )
        split = len(prompt) - max(1, moved)
        # Blocks the target already holds need not cross the network either: it fills
        # them from its own copies (and recomputes them if it dropped them meanwhile).
        split = max(split, self.resident_prefix_tokens(decision.target.instance_id, run))
        kv_id = run.prefill_kv_id
        started = time.monotonic()
        pulled = await self.pull(
            run, decision.target, kv_id, source, split, len(prompt), len(prompt), prompt[:split]
        )
        pull_s = time.monotonic() - started
        target_wait_s, extend_s = await self._extend(run, decision.target, kv_id, run.generated)
        run.decode, run.kv_id = decision.target, kv_id
        return Terms(
            target_wait_s=target_wait_s,
            setup_s=max(0.0, pull_s - max(pulled.transfer_s, pulled.recompute_s)),
            stream_s=pulled.transfer_s,
            prefill_s=pulled.recompute_s,
            extend_s=extend_s,
        ), pulled.kv_bytes

    async def _recompute(self, run: Run, decision: Decision) -> tuple[Terms, int]:
        run.recomputes += 1
        kv_id = f"{run.request.request_id}~r{run.recomputes}"
        context = [*run.request.prompt, *run.generated[:-1]]
        source = decision.source
        run.hold(source, kv_id)
        started = time.monotonic()
        with self.tracer.start_as_current_span("router.prefill") as span:
            span.set_attributes(
                {
                    "kvrs.request_id": run.request.request_id,
                    "kvrs.instance_id": source.instance_id,
                    "kvrs.prompt_tokens": len(context),
                }
            )
            try:
                prefilled = await self.workers.prefill(
                    source,
                    kv_id,
                    context,
                    sampling=run.request.sampling,
                    prompt_tokens=len(run.request.prompt),
                )
            except InvalidArgument:
                raise
            except KvrsError as exc:
                raise StepFailed(await self._lost_one(run, source, exc)) from exc
        prefill_call_s = time.monotonic() - started
        if prefilled.first_token_id != run.generated[-1]:
            log.warning(
                "recompute of %s on %s predicts token %d where %d was generated",
                run.request.request_id,
                source.instance_id,
                prefilled.first_token_id,
                run.generated[-1],
            )
        started = time.monotonic()
        pulled = await self.pull(
            run, decision.target, kv_id, source, 0, len(context), len(run.request.prompt)
        )
        pull_s = time.monotonic() - started
        target_wait_s, extend_s = await self._extend(
            run, decision.target, kv_id, run.generated[-1:]
        )
        run.decode, run.kv_id = decision.target, kv_id
        # The recompute's KV holds the prompt too: later migrations pull from it.
        run.prefill, run.prefill_kv_id, run.prefill_kv_lost = source, kv_id, False
        return Terms(
            source_wait_s=max(0.0, prefill_call_s - prefilled.prefill_s),
            target_wait_s=target_wait_s,
            setup_s=max(0.0, pull_s - pulled.transfer_s),
            stream_s=pulled.transfer_s,
            prefill_s=prefilled.prefill_s,
            extend_s=extend_s,
        ), pulled.kv_bytes

    async def _extend(
        self, run: Run, at: Endpoint, kv_id: str, tokens: Sequence[int]
    ) -> tuple[float, float]:
        """The extend's (wait, compute) seconds: its call's wall time less its forward pass,
        and the forward pass."""
        started = time.monotonic()
        with self.tracer.start_as_current_span("router.extend") as span:
            span.set_attributes(
                {
                    "kvrs.request_id": run.request.request_id,
                    "kvrs.instance_id": at.instance_id,
                    "kvrs.extend_tokens": len(tokens),
                }
            )
            try:
                extended = await self.workers.extend(at, kv_id, tokens, run.request.sampling)
            except InvalidArgument:
                raise
            except KvrsError as exc:
                raise StepFailed(await self._lost_one(run, at, exc)) from exc
        return max(0.0, time.monotonic() - started - extended.extend_s), extended.extend_s

    async def _who_failed(
        self, run: Run, target: Endpoint, source: Endpoint, exc: KvrsError
    ) -> Lost:
        """After a failed pull: the side that stopped answering, else what the error says.

        When both sides answer, only a NotFound says the source lost the KV (released,
        expired or evicted). Any other failure (a timeout, a broken pair) was the path
        between them: the source still holds the KV, so the request goes on from it to
        another target rather than being recomputed, and the target, whose pull broke,
        is the one left out.
        """
        target_alive, source_alive = await asyncio.gather(
            self.workers.is_alive(target, ALIVE_CHECK_TIMEOUT_S),
            self.workers.is_alive(source, ALIVE_CHECK_TIMEOUT_S),
        )
        if not target_alive:
            return Lost(target.instance_id, DETECTED_BY_TRANSFER, f"pull target lost: {exc}")
        if not source_alive:
            return Lost(
                source.instance_id,
                DETECTED_BY_TRANSFER,
                f"pull source lost: {exc}",
                source_lost=True,
            )
        if isinstance(exc, NotFound):
            return Lost(
                source.instance_id,
                DETECTED_BY_TRANSFER,
                f"pull source lost the KV: {exc}",
                source_lost=True,
                unreachable=False,
            )
        return Lost(
            target.instance_id,
            DETECTED_BY_TRANSFER,
            f"pull from {source.instance_id} failed on the way: {exc}",
            unreachable=False,
        )

    async def _lost_one(self, run: Run, at: Endpoint, exc: KvrsError) -> Lost:
        alive = await self.workers.is_alive(at, ALIVE_CHECK_TIMEOUT_S)
        return Lost(
            at.instance_id,
            DETECTED_BY_TRANSFER,
            str(exc),
            source_lost=run.prefill is not None and at.instance_id == run.prefill.instance_id,
            unreachable=not alive,
        )

    @contextlib.asynccontextmanager
    async def _slot(self, decision: Decision):
        """Renews the decision's migration slot while the steps run; releases it after."""
        if not decision.lease_id:
            yield
            return
        renewer = asyncio.create_task(self._renew_forever(decision))
        try:
            yield
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            try:
                await self.slots.release_slot(decision.lease_id)
            except KvrsError as exc:
                log.warning(
                    "releasing slot %s failed (it expires on its own): %s", decision.lease_id, exc
                )

    async def _renew_forever(self, decision: Decision) -> None:
        expires_unix_ms = decision.lease_expires_unix_ms
        while True:
            left_s = expires_unix_ms / 1000.0 - time.time()
            await asyncio.sleep(max(0.1, left_s / 2))
            try:
                expires_unix_ms = await self.slots.renew_slot(decision.lease_id)
            except KvrsError as exc:
                log.warning("renewing slot %s failed: %s", decision.lease_id, exc)
                return
