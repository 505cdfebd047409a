"""One request through the cluster: prefill, placement, KV transfer, decode, recovery.

    prefill on p (first token: streamed at once), SelectDecode -> d alongside it
    d pulls the prompt's KV [0, L) from p as soon as the prefill ends (while token 0
    is still being written to the client)
    Decode on d, streaming tokens 1 .. n-1
    d lost (stream broke, went silent, or gossip says failed):
        Recover / RecoverBatch -> MIGRATE | RECOMPUTE | HYBRID to d', or ABORT
        carry it out (recovery.RecoveryExecutor); a failed step decides again without
        the instance that failed (a lost source turns it into a RECOMPUTE)
        Decode on d' from the next index
    release every KV the request created, on every path

The router keeps the tokens the client has received; a recovery continues from exactly
there, so the client sees one stream with no token repeated or missing. Nothing here
speaks gRPC: `peers.py` supplies the workers and the control plane.

Every executed decision (the placement, each recovery) is measured term by term next to
its prediction once the next token streams, and reported: a `kvrs.outcome` event on the
request's span, the `kvrs_prediction_*` histograms, and ReportOutcome to the scheduler,
which fits its corrections from them (`kvrs.learning`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from opentelemetry.trace import Span, Tracer

from kvrs.admission import DeliveryRate, admits, expected_duration_s
from kvrs.costmodel import prefix_hit_tokens
from kvrs.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvrsError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvrs.learning import TERMS, Outcome, Terms, relative_error
from kvrs.placement import chooses_prefill
from kvrs.prefill import PrefillOption, prefill_finish_s
from kvrs.profile import ComputeProfile
from kvrs.recovery import Action, RecoveryRequest
from kvrs.tokenizer import prefix_block_hashes
from services.common.membership import Membership
from services.common.metrics import Metrics
from services.router.batcher import RecoveryBatcher
from services.router.inflight import InFlight
from services.router.prefill_choice import choose_prefill
from services.router.records import (
    DETECTED_BY_GOSSIP,
    DETECTED_BY_STREAM,
    FINISH_ABORT,
    Awaiting,
    Decision,
    Endpoint,
    GenerateInput,
    Lost,
    Placement,
    RecoveryRecord,
    Run,
    Summary,
    Token,
)
from services.router.recovery import RecoveryExecutor, StepFailed, Workers
from services.router.unreachable import DEFAULT_HOLD_S, Unreachable

log = logging.getLogger(__name__)

MAX_RECOVERIES = 4
"""Recovery attempts per request (every failed step counts) before it fails UNAVAILABLE."""
PREFILL_ATTEMPTS = 2
"""Prefill instances tried before a request fails UNAVAILABLE."""
RELEASE_TIMEOUT_S = 1.0


class Control(Protocol):
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
    ) -> Placement: ...

    async def recover(self, request: RecoveryRequest, failed_id: str, policy: str) -> Decision: ...

    async def recover_batch(
        self, requests: Sequence[RecoveryRequest], failed_id: str, policy: str
    ) -> list[Decision]: ...

    async def renew_slot(self, lease_id: str) -> int: ...

    async def release_slot(self, lease_id: str) -> bool: ...

    async def report_outcome(self, outcome: Outcome) -> None: ...


_T = TypeVar("_T")

INSTANCE_POLL_S = 0.25
"""How often a request with no instance to use (to prefill, place or recover on) looks
again."""
REPLY_MARGIN_S = 0.5
"""A wait for an instance that the request's deadline ends gives up this long before it,
so that the reply saying why reaches the caller before its own deadline cuts the call."""


class Aborted(Exception):
    """The request cannot continue; `error` is the status the stream ends with."""

    def __init__(self, error: KvrsError) -> None:
        super().__init__(str(error))
        self.error = error


class _End:
    """The Decode stream ended."""


@dataclass(frozen=True)
class RouterSettings:
    default_placement_policy: str = ""
    default_recovery_policy: str = ""
    block_tokens: int = 512
    decode_idle_timeout_s: float = 10.0
    batch_window_s: float = 0.05
    instance_wait_s: float = 5.0
    max_requests_per_decode: int = 0
    deadline_admission: bool = False
    stream_kv: bool = True
    """Layer-wise streaming: the decode instance pulls the KV while the prefill computes
    it, each layer as soon as it is done, instead of after the prefill."""
    stream_kv_min_tokens: int = 512
    """Prompts shorter than this move their KV after the prefill all the same."""
    vocab_size: int = 0
    """The served model's vocabulary (0: unknown), which prompts are checked against."""
    max_positions: int = 0
    """The served model's longest sequence (0: unknown)."""


class Router:
    """Runs requests (see the module docstring); one per process, shared by every call."""

    def __init__(
        self,
        workers: Workers,
        control: Control,
        membership: Membership,
        profile: ComputeProfile,
        tracer: Tracer,
        metrics: Metrics,
        settings: RouterSettings,
    ) -> None:
        self.workers = workers
        self.control = control
        self.membership = membership
        self.profile = profile
        self.tracer = tracer
        self.metrics = metrics
        self.settings = settings
        self.batcher = RecoveryBatcher(control, settings.batch_window_s)
        self.executor = RecoveryExecutor(workers, control, tracer, self._resident_prefix_tokens)
        self.inflight = InFlight()
        """Decisions being carried out, for each outcome's `target_jobs`."""
        self.unreachable = Unreachable()
        """Instances whose streams or calls just broke: no new placements there for a TTL."""
        self._decoding: dict[str, set[Run]] = {}
        self._inboxes: dict[Run, tuple[str, asyncio.Queue]] = {}
        self._prefill_inflight_s: dict[str, float] = {}
        self._reports: set[asyncio.Task] = set()
        self._admitted = 0
        """Requests between admission and their last message."""
        self.delivered = DeliveryRate()
        """Tokens streamed to clients lately: what deadline admission judges by."""
        membership.add_failure_listener(self._gossip_failure)
        # Every action's series exists from the start, at zero: a dashboard shows "0
        # recoveries" rather than no data until the first failure.
        for action in Action:
            metrics.recovery_predicted_s.labels(action=action.value)
            metrics.recovery_actual_s.labels(action=action.value)

    # -- the request ----------------------------------------------------------------

    async def generate(self, request: GenerateInput) -> AsyncGenerator[Token | Summary, None]:
        """Tokens in order, then the summary; raises the KvrsError the stream ends with."""
        request.validate(self.settings.vocab_size, self.settings.max_positions)
        started = time.monotonic()
        run = Run(
            request=request,
            summary=Summary(request_id=request.request_id, prompt_tokens=len(request.prompt)),
            policy=request.recovery_policy or self.settings.default_recovery_policy,
            prefix_hashes=tuple(prefix_block_hashes(request.prompt, self.settings.block_tokens)),
        )
        outcome = "failed"
        with self.tracer.start_as_current_span("router.generate") as span:
            span.set_attributes(
                {
                    "kvrs.request_id": request.request_id,
                    "kvrs.prompt_tokens": len(request.prompt),
                    "kvrs.max_new_tokens": request.max_new_tokens,
                    "kvrs.deadline_unix_ms": request.deadline_unix_ms,
                }
            )
            context = span.get_span_context()
            # Untraced (no exporter): no trace to name.
            run.summary.trace_id = format(context.trace_id, "032x") if context.is_valid else ""
            run.span = span
            self._admit(request, span)
            self._admitted += 1
            tasks: list[asyncio.Task] = []
            try:
                first, placing = await self._prefill(run, tasks)
                run.generated.append(first)
                self._first_token(run, started)
                self.delivered.add(time.monotonic())
                if placing is None and run.remaining_tokens > 0:
                    # Started before token 0 is handed out: the pull must not wait for the
                    # client's write (the generator is suspended at the yield until then).
                    placing = asyncio.create_task(self._place(run, tasks[-1]))
                    tasks.append(placing)
                yield Token(0, first)
                if placing is not None:
                    last_s = time.monotonic()
                    async for token in self._decode_all(run, placing):
                        now_s = time.monotonic()
                        self.metrics.tbt_s.observe(now_s - last_s)
                        self.delivered.add(now_s)
                        last_s = now_s
                        yield token
                self._finish(run, started, span)
                outcome = "recovered" if run.summary.recoveries else "completed"
                yield run.summary
            except Aborted as aborted:
                outcome = "aborted"
                run.summary.finish_reason = FINISH_ABORT
                self._finish(run, started, span)
                yield run.summary
                raise aborted.error from None
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self._admitted -= 1
                self.metrics.requests.labels(outcome=outcome).inc()
                span.set_attribute("kvrs.outcome", outcome)
                # Shielded as a whole: a second cancellation (a client hanging up while the
                # stream closes) must not stop between settling the placement and the
                # release, or KV stays on a worker.
                await asyncio.shield(self._close(run, tasks))

    def _admit(self, request: GenerateInput, span: Span) -> None:
        """Sheds the request when the cluster already has its fill: more requests in
        flight than `max_requests_per_decode` for each alive decode instance, or (with
        deadline admission) more than it can finish this one among by its deadline.
        Refused at once, a client can retry elsewhere or later; admitted, it would queue
        behind work the cluster cannot finish in time, and slow every stream already
        running."""
        per_decode = self.settings.max_requests_per_decode
        decodes = len(self.membership.alive("decode")) if per_decode else 0
        if decodes and self._admitted >= per_decode * decodes:
            self._shed(span)
            raise ResourceExhausted(
                f"{self._admitted} requests in flight, the most for {decodes} alive decode "
                f"instances ({per_decode} each); retry later",
                field="max_requests_per_decode",
            )
        if not (self.settings.deadline_admission and request.deadline_unix_ms):
            return
        left_s = request.deadline_unix_ms / 1000.0 - time.time()
        rate = self.delivered.per_s(time.monotonic())
        if admits(request.max_new_tokens, self._admitted, rate, left_s):
            return
        self._shed(span)
        expected_s = expected_duration_s(request.max_new_tokens, self._admitted, rate)
        raise ResourceExhausted(
            f"{request.max_new_tokens} tokens would take about {expected_s:.1f} s, sharing "
            f"the {rate:.0f} tokens/s the cluster delivers now with {self._admitted} "
            f"requests in flight, past the deadline {left_s:.1f} s away; retry later",
            field="deadline_unix_ms",
        )

    def _shed(self, span: Span) -> None:
        self.metrics.requests.labels(outcome="shed").inc()
        span.set_attribute("kvrs.outcome", "shed")

    def _first_token(self, run: Run, started: float) -> None:
        summary = run.summary
        summary.ttft_s = time.monotonic() - started
        self.metrics.ttft_s.observe(summary.ttft_s)
        slo = run.request.ttft_slo_s
        summary.ttft_slo_met = slo == 0 or summary.ttft_s <= slo

    def _finish(self, run: Run, started: float, span: Span) -> None:
        summary = run.summary
        summary.total_s = time.monotonic() - started
        summary.generated_tokens = len(run.generated)
        summary.final_decode_instance_id = (
            run.decode.instance_id if run.decode is not None else summary.decode_instance_id
        )
        span.set_attributes(
            {
                "kvrs.generated_tokens": summary.generated_tokens,
                "kvrs.recoveries": len(summary.recoveries),
                "kvrs.ttft_s": summary.ttft_s,
            }
        )

    # -- prefill and placement ------------------------------------------------------

    async def _prefill(
        self, run: Run, tasks: list[asyncio.Task]
    ) -> tuple[int, asyncio.Task | None]:
        """The first token; `tasks` gets the placement (SelectDecode) of the prefill
        instance that answered, asked while the prefill runs (it needs only the prompt's
        length and hashes and where its KV will be).

        With layer-wise streaming (`RouterSettings.stream_kv`, for prompts of at least
        `stream_kv_min_tokens`) the chosen decode instance also starts pulling the KV as
        soon as the placement is known, while the prefill computes it; that pull's task
        is returned with the token (else None)."""
        request = run.request
        hashes = run.prefix_hashes
        tried: set[str] = set()
        last_error: KvrsError | None = None
        for _ in range(PREFILL_ATTEMPTS):
            try:
                at, work_s, options = await self._until_an_instance(
                    lambda first: self._prefill_instance(request, hashes, tried),
                    request.deadline_unix_ms,
                    run.span,
                    "kvrs.prefill.waiting",
                )
            except FailedPrecondition as exc:
                raise Unavailable(str(exc)) from None
            streaming = None
            if request.max_new_tokens > 1:
                selecting = asyncio.create_task(self._select(request, at, hashes, options))
                tasks.append(selecting)
                if options:
                    # The policy chooses the prefill with the decode side in view: the
                    # prompt goes where the placement says, one SelectDecode later.
                    placement, _ = await selecting
                    at, work_s = self._prefill_chosen(request, placement, options, at, work_s)
                if self._streams(request):
                    run.prefill, run.prefill_kv_id = at, request.request_id
                    prefilled_at: asyncio.Future[float] = asyncio.Future()
                    streaming = asyncio.create_task(self._place(run, selecting, prefilled_at))
                    tasks.append(streaming)
            tried.add(at.instance_id)
            inflight = self._prefill_inflight_s
            inflight[at.instance_id] = inflight.get(at.instance_id, 0.0) + work_s
            run.hold(at, request.request_id)
            try:
                with self.tracer.start_as_current_span("router.prefill") as span:
                    span.set_attributes(
                        {
                            "kvrs.request_id": request.request_id,
                            "kvrs.instance_id": at.instance_id,
                            "kvrs.prompt_tokens": len(request.prompt),
                        }
                    )
                    prefilled = await self.workers.prefill(
                        at, request.request_id, request.prompt, sampling=request.sampling
                    )
            except (InvalidArgument, FailedPrecondition):
                raise
            except KvrsError as exc:
                log.warning(
                    "prefill of %s on %s failed: %s", request.request_id, at.instance_id, exc
                )
                last_error = exc
                # That placement priced the KV coming from `at`: ask again for the next.
                await _settle(tasks)
                tasks.clear()
                continue
            finally:
                inflight[at.instance_id] = max(0.0, inflight[at.instance_id] - work_s)
            run.prefill, run.prefill_kv_id = at, request.request_id
            run.summary.prefill_instance_id = at.instance_id
            run.summary.prefill_s = prefilled.prefill_s
            run.summary.prefix_hit_tokens = prefilled.prefix_hit_tokens
            if streaming is not None:
                prefilled_at.set_result(time.monotonic())
            return prefilled.first_token_id, streaming
        raise Unavailable(f"prefill failed on {', '.join(sorted(tried))}: {last_error}")

    def _streams(self, request: GenerateInput) -> bool:
        """Whether the request's KV streams while it prefills (layer-wise streaming)."""
        settings = self.settings
        return settings.stream_kv and len(request.prompt) >= settings.stream_kv_min_tokens

    async def _prefill_instance(
        self, request: GenerateInput, hashes: Sequence[int], tried: set[str]
    ) -> tuple[Endpoint, float, tuple[PrefillOption, ...]]:
        """The prefill instance to try next, the prompt's compute there (s), and every
        candidate as an option when the placement policy chooses the prefill too (else
        none); FailedPrecondition while there is none (every one down or tried already)."""
        if request.prefill_instance_id:
            known = self.membership.instance(request.prefill_instance_id)
            if known is None:
                raise NotFound(
                    f"unknown instance {request.prefill_instance_id!r}", field="prefill_instance_id"
                )
            if request.prefill_instance_id in tried:
                raise Unavailable(f"prefill instance {request.prefill_instance_id} failed")
            return (
                Endpoint(known.instance_id, known.address),
                self.profile.prefill_s(len(request.prompt)),
                (),
            )
        candidates = [i for i in self.membership.alive("prefill") if i.instance_id not in tried]
        if not candidates:
            raise FailedPrecondition(
                "no alive prefill instance"
                + (f" besides {', '.join(sorted(tried))}" if tried else "")
            )
        policy = request.placement_policy or self.settings.default_placement_policy
        choice = choose_prefill(
            candidates,
            len(request.prompt),
            hashes,
            self.settings.block_tokens,
            self.profile,
            self._prefill_inflight_s,
            options=len(candidates) > 1 and chooses_prefill(policy),
        )
        chosen = choice.instance
        return Endpoint(chosen.instance_id, chosen.address), choice.work_s, choice.options

    def _prefill_chosen(
        self,
        request: GenerateInput,
        placement: Placement,
        options: Sequence[PrefillOption],
        routed: Endpoint,
        work_s: float,
    ) -> tuple[Endpoint, float]:
        """The prefill instance the placement chose among `options`, and the prompt's
        compute there; `routed` (the prefill rule's own choice) when it kept that one."""
        if placement.prefill_id == routed.instance_id:
            return routed, work_s
        chosen = self.membership.instance(placement.prefill_id)
        option = next((o for o in options if o.instance_id == placement.prefill_id), None)
        if chosen is None or option is None:
            log.warning(
                "SelectDecode chose prefill %r, not among the options; prefilling on %s",
                placement.prefill_id,
                routed.instance_id,
            )
            return routed, work_s
        moved_work_s = prefill_finish_s(
            self.profile, len(request.prompt), 0.0, option.prefix_hit_tokens
        )
        return Endpoint(chosen.instance_id, chosen.address), moved_work_s

    def _resident_prefix_tokens(self, instance_id: str, run: Run) -> int:
        """Leading whole blocks of the run's prompt that `instance_id` heartbeats as
        resident, short of the whole prompt (a pull moves at least one token)."""
        instance = self.membership.instance(instance_id)
        if instance is None or not instance.resident_prefix_hashes:
            return 0
        block = self.settings.block_tokens
        prompt_tokens = len(run.request.prompt)
        hit = prefix_hit_tokens(
            run.prefix_hashes, instance.resident_prefix_hashes, block, prompt_tokens
        )
        return min(hit, (prompt_tokens - 1) // block * block)

    async def _select(
        self,
        request: GenerateInput,
        prefill: Endpoint,
        hashes: Sequence[int],
        prefill_options: Sequence[PrefillOption] = (),
    ) -> tuple[Placement, float]:
        """The placement, and when it was asked for (unix s: its outcome's time)."""
        # One turn of the loop first: the prefill call, issued right after this task was
        # created, goes on the wire before this request is built and sent (the placement
        # is needed only when the prefill ends, the prefill's first byte is needed now).
        await asyncio.sleep(0)
        decided_unix_s = time.time()
        pinned = (request.decode_instance_id,) if request.decode_instance_id else ()
        avoided = sorted(self.unreachable.current()) if not pinned else []
        policy = request.placement_policy or self.settings.default_placement_policy

        def select(excluded: Sequence[str]) -> Awaitable[Placement]:
            return self.control.select_decode(
                request.request_id,
                prefill.instance_id,
                len(request.prompt),
                hashes,
                policy,
                pinned,
                excluded,
                streamed=self._streams(request),
                prefill_options=prefill_options,
            )

        async def place(first: bool) -> Placement:
            try:
                return await select(avoided)
            except (ResourceExhausted, FailedPrecondition):
                if not avoided:
                    raise
                # Nothing else can take it: the instances avoided are tried after all.
                return await select(())

        with self.tracer.start_as_current_span("router.select_decode") as span:
            # No decode instance at all (every one lost, suspect or restarting): the
            # prefilled KV waits for one to come back.
            placement = await self._until_an_instance(
                place, request.deadline_unix_ms, span, "kvrs.placement.waiting"
            )
        return placement, decided_unix_s

    async def _place(
        self,
        run: Run,
        selecting: asyncio.Task,
        prefilled_at: asyncio.Future[float] | None = None,
    ) -> Lost | None:
        """The placement `selecting` asks for, then the chosen instance pulls the KV.

        With `prefilled_at` the pull streams while the prefill computes (layer-wise
        streaming); the future says when the prefill answered (monotonic s).
        Returns the instance lost during the pull (recovery takes over), None on success.
        """
        request = run.request
        assert run.prefill is not None
        placement, decided_unix_s = await selecting
        summary = run.summary
        summary.decode_instance_id = placement.decode.instance_id
        summary.predicted_ttft_s = placement.predicted_ttft_s
        prompt_tokens = len(request.prompt)
        # Counted among the instance's requests from now on, so a failure during the pull
        # is planned together with the requests already decoding there.
        self._attach(run, placement.decode, asyncio.Queue())
        started = time.monotonic()
        running = self.decoding_on(placement.decode.instance_id) - 1
        # Only the blocks the target lacks cross the network: the leading prompt blocks
        # it advertises resident are filled from its own copies (recomputed there if it
        # dropped them since its last heartbeat).
        held = self._resident_prefix_tokens(placement.decode.instance_id, run)
        try:
            with self.inflight.running() as share:
                pulled = await self.executor.pull(
                    run,
                    placement.decode,
                    run.prefill_kv_id,
                    run.prefill,
                    held,
                    prompt_tokens,
                    prompt_tokens,
                    request.prompt[:held],
                    while_prefilling=prefilled_at is not None,
                )
        except StepFailed as failed:
            return failed.lost
        kv_ready_s = time.monotonic()
        summary.kv_transfer_s = pulled.transfer_s
        summary.kv_bytes = pulled.kv_bytes
        self.metrics.transfer_bytes.labels(direction="placement").inc(pulled.kv_bytes)
        run.decode, run.kv_id = placement.decode, run.prefill_kv_id
        predicted = _with(placement.predicted, prefill_s=self.profile.prefill_s(prompt_tokens))
        measured = Terms(
            setup_s=max(0.0, kv_ready_s - started - pulled.transfer_s),
            stream_s=pulled.transfer_s,
            prefill_s=summary.prefill_s,
        )
        if prefilled_at is not None:
            # Streamed under the prefill: measured, as predicted, from the prefill's end:
            # what the transfer adds is the part of it the prefill did not hide.
            started = max(started, await prefilled_at)
            measured = Terms(stream_s=max(0.0, kv_ready_s - started), prefill_s=summary.prefill_s)
        run.awaiting = Awaiting(
            kind="placement",
            source_id=run.prefill.instance_id,
            target_id=placement.decode.instance_id,
            decided_unix_s=decided_unix_s,
            started_s=started,
            kv_ready_s=kv_ready_s,
            predicted=predicted,
            measured=measured,
            streamed=prefilled_at is not None,
            kv_bytes=pulled.kv_bytes,
            prefill_tokens=prompt_tokens,
            cached_tokens=prompt_tokens,
            extend_tokens=1,
            target_running=running,
            target_jobs=share.peak,
        )
        return None

    # -- decode and recovery --------------------------------------------------------

    async def _decode_all(self, run: Run, placing: asyncio.Task) -> AsyncIterator[Token]:
        lost = await placing
        attempts = 0
        while run.remaining_tokens > 0:
            if lost is None:
                async for token in self._decode_phase(run):
                    yield token
                lost = run.pending_loss
                run.pending_loss = None
                if lost is None or run.remaining_tokens == 0:
                    break
            attempts += 1
            if attempts > MAX_RECOVERIES:
                raise Aborted(
                    Unavailable(
                        f"request {run.request.request_id} failed {MAX_RECOVERIES} recoveries in "
                        f"a row; last lost {lost.instance_id}: {lost.reason}"
                    )
                )
            lost = await self._recover(run, lost, batchable=attempts == 1)
        self._detach(run)

    async def _decode_phase(self, run: Run) -> AsyncIterator[Token]:
        """Streams run.decode's tokens until done or lost (then `run.pending_loss` is set).

        The request stays attached to the instance after a loss, so the requests lost
        with it are counted when their recoveries are batched; `_recover` detaches it.
        """
        at = run.decode
        assert at is not None
        inbox: asyncio.Queue = asyncio.Queue()
        self._attach(run, at, inbox)
        pump = asyncio.create_task(self._pump(run, at, inbox))
        idle_s = self.settings.decode_idle_timeout_s
        try:
            while run.remaining_tokens > 0:
                try:
                    async with asyncio.timeout(idle_s):
                        item = await inbox.get()
                except TimeoutError:
                    item = Lost(
                        at.instance_id,
                        DETECTED_BY_STREAM,
                        f"decode stream silent for {idle_s:.1f} s",
                    )
                if isinstance(item, tuple):
                    index, token_id, step_s = item
                    if index != len(run.generated):
                        raise KvrsError(
                            f"{at.instance_id} streamed index {index} where "
                            f"{len(run.generated)} was next"
                        )
                    run.generated.append(token_id)
                    awaiting, arrived_s = run.awaiting, time.monotonic()
                    run.awaiting = None
                    yield Token(index, token_id)
                    if awaiting is not None:
                        # Measured at the token's arrival, booked once it is on its way
                        # to the client: metrics and the report stay off token 1's path.
                        self._outcome(run, awaiting, step_s, arrived_s)
                elif isinstance(item, _End):
                    if run.remaining_tokens > 0:
                        run.pending_loss = Lost(
                            at.instance_id,
                            DETECTED_BY_STREAM,
                            f"decode stream ended after {len(run.generated)} tokens",
                            unreachable=False,
                        )
                    break
                elif isinstance(item, Lost):
                    run.pending_loss = item
                    break
                else:
                    raise item
        finally:
            pump.cancel()
            try:
                await pump
            except asyncio.CancelledError:
                pass
        if run.pending_loss is None:
            self._detach(run)

    async def _pump(self, run: Run, at: Endpoint, inbox: asyncio.Queue) -> None:
        """Moves the Decode stream's tokens into `inbox`; a failure becomes a `Lost`."""
        try:
            async for item in self.workers.decode(
                at,
                run.kv_id,
                run.generated,
                run.remaining_tokens,
                release_when_done=True,
                sampling=run.request.sampling,
            ):
                inbox.put_nowait(item)
            inbox.put_nowait(_End())
        except InvalidArgument as exc:
            inbox.put_nowait(exc)
        except KvrsError as exc:
            unreachable = isinstance(exc, Unavailable)
            lost = Lost(
                at.instance_id,
                DETECTED_BY_STREAM,
                f"decode stream broke: {exc}",
                unreachable=unreachable,
            )
            if unreachable:
                # The instance itself is unreachable: its other requests are lost too.
                self._instance_lost(lost)
            else:
                inbox.put_nowait(lost)

    def _attach(self, run: Run, at: Endpoint, inbox: asyncio.Queue) -> None:
        self._detach(run)
        self._decoding.setdefault(at.instance_id, set()).add(run)
        self._inboxes[run] = (at.instance_id, inbox)

    def _detach(self, run: Run) -> None:
        attached = self._inboxes.pop(run, None)
        if attached is None:
            return
        runs = self._decoding.get(attached[0])
        if runs is not None:
            runs.discard(run)
            if not runs:
                del self._decoding[attached[0]]

    def _instance_lost(self, lost: Lost) -> None:
        for run in list(self._decoding.get(lost.instance_id, ())):
            self._inboxes[run][1].put_nowait(lost)

    def _gossip_failure(self, instance_id: str, reason: str) -> None:
        self._instance_lost(Lost(instance_id, DETECTED_BY_GOSSIP, reason))

    def decoding_on(self, instance_id: str, policy: str | None = None) -> int:
        """Requests decoding on `instance_id` now (with recovery policy `policy`)."""
        return sum(
            1
            for run in self._decoding.get(instance_id, ())
            if policy is None or run.policy == policy
        )

    async def _recover(self, run: Run, lost: Lost, batchable: bool) -> Lost | None:
        """One decision and its steps; None once run.decode can decode, else what failed."""
        request = run.request
        assert run.prefill is not None
        run.lose(lost)
        if lost.unreachable:
            known = self.membership.instance(lost.instance_id)
            ttl_s = known.heartbeat_ttl_s if known is not None else 0.0
            self.unreachable.note(lost.instance_id, ttl_s or DEFAULT_HOLD_S)
        if lost.source_lost and lost.instance_id == run.prefill.instance_id:
            run.prefill_kv_lost = True
        if self.membership.is_down(run.prefill.instance_id):
            run.prefill_kv_lost = True
        record = RecoveryRecord(
            failed_instance_id=lost.instance_id,
            detected_by=lost.detected_by,
            generated_tokens=len(run.generated),
            policy=run.policy,
            lost_reason=lost.reason,
        )
        run.summary.recoveries.append(record)
        log.info(
            "recovering %s after %d tokens: %s lost (%s: %s)",
            request.request_id,
            len(run.generated),
            lost.instance_id,
            lost.detected_by,
            lost.reason,
        )
        with self.tracer.start_as_current_span("router.recover") as span:
            span.set_attributes(
                {
                    "kvrs.request_id": request.request_id,
                    "kvrs.failed_instance_id": lost.instance_id,
                    "kvrs.detected_by": lost.detected_by,
                    "kvrs.lost_reason": lost.reason,
                    "kvrs.generated_tokens": len(run.generated),
                    "kvrs.source_kv_lost": run.prefill_kv_lost,
                }
            )
            decision = await self._decide(run, lost, batchable, record)
            _annotate_decision(span, decision)
            if decision.action is Action.ABORT:
                record.error = decision.reason
                raise Aborted(_abort_error(run, decision))
            decided_unix_s = time.time()
            running = self.decoding_on(decision.target.instance_id)
            started = time.monotonic()
            try:
                with (
                    self.tracer.start_as_current_span("router.recover.execute"),
                    self.inflight.running() as share,
                ):
                    steps, moved_bytes = await self.executor.execute(run, decision)
            except StepFailed as failed:
                record.measured_s = time.monotonic() - started
                record.error = str(failed)
                span.set_attribute("kvrs.recovery.error", record.error)
                return failed.lost
            kv_ready_s = time.monotonic()
            record.measured_s = kv_ready_s - started
            record.measured = _with(steps, total_s=record.measured_s)
            record.succeeded = True
            span.set_attribute("kvrs.recovery.measured_s", record.measured_s)
            span.set_attributes(_term_attributes(decision.predicted, record.measured))
            action = decision.action.value
            self.metrics.recovery_predicted_s.labels(action=action).observe(
                decision.predicted_cost_s
            )
            self.metrics.recovery_actual_s.labels(action=action).observe(record.measured_s)
            prompt_tokens = len(request.prompt)
            if decision.action is Action.RECOMPUTE:
                context = prompt_tokens + len(run.generated) - 1
                prefill_tokens, cached, extended = context, context, 1
            else:
                split = decision.split_tokens if decision.action is Action.HYBRID else 0
                prefill_tokens, cached, extended = split, prompt_tokens, len(run.generated)
            run.awaiting = Awaiting(
                kind=action,
                source_id=decision.source.instance_id,
                target_id=decision.target.instance_id,
                decided_unix_s=decided_unix_s,
                started_s=started,
                kv_ready_s=kv_ready_s,
                predicted=decision.predicted,
                measured=record.measured,
                kv_bytes=moved_bytes,
                prefill_tokens=prefill_tokens,
                cached_tokens=cached,
                extend_tokens=extended,
                target_running=running,
                target_jobs=share.peak,
                record=record,
            )
            return None

    def _outcome(self, run: Run, awaiting: Awaiting, step_s: float, now_s: float) -> None:
        """Completes an executed decision's measurement at its first token (which arrived
        at `now_s`, monotonic) and reports it."""
        first_token_s = now_s - awaiting.started_s
        predicted = awaiting.predicted
        if awaiting.kind == "placement":
            # The decode instance fed the first token as an extend: its wait and compute,
            # from when the KV was in and the prefill had answered (a streamed KV can be
            # in before the prefill's answer reaches the router).
            ready_s = max(awaiting.kv_ready_s, awaiting.started_s)
            measured = _with(
                awaiting.measured,
                target_wait_s=max(0.0, now_s - ready_s - step_s),
                extend_s=step_s,
                total_s=first_token_s,
                first_token_s=first_token_s,
            )
            run.summary.placement_measured_s = first_token_s
            run.summary.placement_predicted_s = predicted.total_s
        else:
            measured = _with(awaiting.measured, first_token_s=first_token_s)
            if awaiting.record is not None:
                awaiting.record.measured = measured
        outcome = Outcome(
            kind=awaiting.kind,
            request_id=run.request.request_id,
            source_id=awaiting.source_id,
            target_id=awaiting.target_id,
            at_s=awaiting.decided_unix_s,
            predicted=predicted,
            measured=measured,
            kv_bytes=awaiting.kv_bytes,
            prefill_tokens=awaiting.prefill_tokens,
            cached_tokens=awaiting.cached_tokens,
            extend_tokens=awaiting.extend_tokens,
            target_running=awaiting.target_running,
            target_jobs=awaiting.target_jobs,
            streamed=awaiting.streamed,
        )
        for term in TERMS:
            p, m = getattr(predicted, term), getattr(measured, term)
            if p <= 0.0 and m <= 0.0:
                continue
            self.metrics.prediction_error.labels(outcome.kind, term).observe(relative_error(p, m))
            if p > 0.0:
                self.metrics.prediction_ratio.labels(outcome.kind, term).observe(m / p)
        if run.span is not None:
            run.span.add_event(
                "kvrs.outcome",
                {"kvrs.outcome.kind": outcome.kind, **_term_attributes(predicted, measured)},
            )
        task = asyncio.get_running_loop().create_task(self._report(outcome))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report(self, outcome: Outcome) -> None:
        try:
            await self.control.report_outcome(outcome)
        except KvrsError as exc:
            # The measurement is on the span and the metrics already; the fit misses one.
            log.info(
                "reporting the %s outcome of %s failed: %s", outcome.kind, outcome.request_id, exc
            )

    async def _decide(
        self, run: Run, lost: Lost, batchable: bool, record: RecoveryRecord
    ) -> Decision:
        request = run.request
        assert run.prefill is not None
        source_prefill_id = run.prefill.instance_id
        started = time.monotonic()

        def ask(first: bool) -> Awaitable[Decision]:
            # An instance that failed this request earlier is left out, unless it has been
            # restarted since (asked again while the request waits for an instance, it may
            # have been): in a small cluster the request may have nowhere else to go.
            exclude = frozenset(
                instance_id
                for instance_id, lost_s in run.failed.items()
                if instance_id != lost.instance_id
                and not self.membership.joined_since(instance_id, lost_s)
            )
            item = RecoveryRequest(
                request_id=request.request_id,
                prompt_tokens=len(request.prompt),
                generated_tokens=len(run.generated),
                source_prefill_id=source_prefill_id,
                deadline_s=request.deadline_unix_ms / 1000.0 if request.deadline_unix_ms else None,
                source_kv_available=not run.prefill_kv_lost,
                exclude_ids=exclude,
                prefix_hashes=run.prefix_hashes,
            )
            # Only the first ask joins a batch: the others of it were decided meanwhile.
            return self._ask(run, item, lost, first and batchable and not exclude)

        try:
            with self.tracer.start_as_current_span("router.recover.decide") as span:
                # Nothing to recover to right now (every decode instance lost or suspect):
                # one may come back within the wait.
                decision = await self._until_an_instance(
                    ask, request.deadline_unix_ms, span, "kvrs.recovery.waiting"
                )
        except InvalidArgument:
            raise
        except KvrsError as exc:
            record.error = f"no recovery plan: {exc}"
            why = f"request {request.request_id} cannot continue after losing {lost.instance_id}"
            if isinstance(exc, WaitPastDeadline):
                raise Aborted(DeadlineExceeded(f"{why}: {exc}")) from exc
            raise Aborted(Unavailable(f"{why}: {exc}")) from exc
        finally:
            record.decision_s = time.monotonic() - started
            self._detach(run)
        record.decision = decision
        return decision

    async def _ask(self, run: Run, item: RecoveryRequest, lost: Lost, batchable: bool) -> Decision:
        if batchable:
            expected = self.decoding_on(lost.instance_id, run.policy)
            return await self.batcher.decide(item, lost.instance_id, run.policy, expected)
        return await self.control.recover(item, lost.instance_id, run.policy)

    async def _until_an_instance(
        self,
        ask: Callable[[bool], Awaitable[_T]],
        deadline_unix_ms: int,
        span: Span | None,
        event: str,
    ) -> _T:
        """`ask(first)`'s answer (`first`: no ask before it). While it fails for want of
        an instance (FAILED_PRECONDITION: none alive, or every one lost, suspect or
        excluded), asks again every `INSTANCE_POLL_S` for up to the configured wait, never
        past the request's deadline, recording each wait as `event` on `span`: a suspect
        instance is refuted or a restarted one registers within seconds, and the request
        goes on there instead of failing. A wait the deadline ends is DEADLINE_EXCEEDED,
        as a recovery aborted for its deadline is, given `REPLY_MARGIN_S` before the
        deadline; one the configured wait ends, the FAILED_PRECONDITION of the last ask
        (made when the wait ends)."""
        wait_s = self.settings.instance_wait_s
        until_deadline = False
        if deadline_unix_ms:
            left_s = deadline_unix_ms / 1000.0 - time.time() - REPLY_MARGIN_S
            until_deadline = left_s < wait_s
            wait_s = min(wait_s, left_s)
        give_up_s = time.monotonic() + wait_s
        first = True
        while True:
            try:
                return await ask(first)
            except FailedPrecondition as exc:
                left_s = give_up_s - time.monotonic()
                if left_s <= 0.0:
                    if until_deadline:
                        raise WaitPastDeadline(
                            f"the request's deadline comes before an instance does: {exc}"
                        ) from None
                    raise
                if span is not None:
                    span.add_event(event, {"kvrs.reason": str(exc)})
                await asyncio.sleep(min(INSTANCE_POLL_S, left_s))
                first = False

    async def _close(self, run: Run, tasks: list[asyncio.Task]) -> None:
        """Ends the request's background work, then releases every KV it created."""
        await _settle(tasks)
        self._detach(run)
        await self._release_all(run)

    async def _release_all(self, run: Run) -> None:
        """ReleaseKv of every KV the request created, except where nothing answers."""
        targets = [
            (at, kv_id)
            for (instance_id, kv_id), at in run.held.items()
            if instance_id not in run.unreachable
        ]
        run.held.clear()
        results = await asyncio.gather(
            *(self.workers.release_kv(at, kv_id, RELEASE_TIMEOUT_S) for at, kv_id in targets),
            return_exceptions=True,
        )
        for (at, kv_id), result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.info(
                    "releasing %s on %s failed (its lease expires it): %s",
                    kv_id,
                    at.instance_id,
                    result,
                )


class WaitPastDeadline(DeadlineExceeded):
    """The request's own deadline came while it waited for an instance (not a call of
    the router's that timed out: that one is the control plane's failure)."""


def _abort_error(run: Run, decision: Decision) -> KvrsError:
    why = f"request {run.request.request_id} aborted on recovery: {decision.reason}"
    if math.isfinite(decision.slo_slack_s) and decision.slo_slack_s < 0:
        return DeadlineExceeded(
            f"{why} (predicted {decision.predicted_cost_s:.3f} s, "
            f"slack {decision.slo_slack_s:.3f} s)"
        )
    return Unavailable(why)


def _with(terms: Terms, **values: float) -> Terms:
    return dataclasses.replace(terms, **values)


def _term_attributes(predicted: Terms, measured: Terms) -> dict[str, float]:
    """`kvrs.predicted.<term>` and `kvrs.measured.<term>` of every term either side has."""
    attributes: dict[str, float] = {}
    for term in TERMS:
        p, m = getattr(predicted, term), getattr(measured, term)
        if p > 0.0 or m > 0.0:
            attributes[f"kvrs.predicted.{term}"] = p
            attributes[f"kvrs.measured.{term}"] = m
    return attributes


def _annotate_decision(span: Span, decision: Decision) -> None:
    span.set_attributes(
        {
            "kvrs.action": decision.action.value,
            "kvrs.target_instance_id": decision.target.instance_id,
            "kvrs.source_instance_id": decision.source.instance_id,
            "kvrs.cost_s": decision.predicted_cost_s,
            "kvrs.split_tokens": decision.split_tokens,
            "kvrs.reason": decision.reason,
            "kvrs.batch.size": decision.batch_size,
        }
    )
    if math.isfinite(decision.slo_slack_s):
        span.set_attribute("kvrs.slo_slack_s", decision.slo_slack_s)


async def _settle(tasks: list[asyncio.Task]) -> None:
    """Cancels what is still running of `tasks` and waits until all of them are done.

    Their outcomes are collected, not raised: the request has already consumed the ones it
    waited for, and the others (a placement for a prefill that failed, or for a request
    that ended early) no longer matter.
    """
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
