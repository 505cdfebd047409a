"""The compute loop: a worker's forward passes, batched, on one thread.

Continuous batching. Between steps the loop takes every queued piece of work — the next
token of each running decode stream, the prefills and extends waiting — up to a token
budget per step (WORKER_MAX_BATCH_TOKENS), and runs them as one forward pass
(`Transformer.forward_batch`); each gets its logits. Requests join and leave between
steps. Work longer than the budget is computed in chunks over several steps, so running
streams keep stepping while a long prompt prefills.

One thread, because a CPU worker gains nothing from running two forward passes at once
(they would share the same cores). What gossip reports as queued work is honest under
batching: the estimated seconds until work submitted now would start, i.e. the rest of
the running step plus the steps the queued work fills ahead of it, each priced by the
profile (`kvrs.profile.ComputeProfile.pass_s`) and scaled by how much
slower than that profile this worker's recent passes ran (`services.worker.pace`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from kvrs.errors import InvalidArgument
from kvrs.passes import pack
from kvrs.profile import ComputeProfile, compute_profile
from services.common.metrics import Metrics
from services.worker.config import DEFAULT_MAX_BATCH_TOKENS
from services.worker.model import Transformer
from services.worker.pace import PassPace
from services.worker.paged_kv import KvCache

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Timed(Generic[T]):
    """A pass's result with the time it waited and the time it ran."""

    value: T
    queued_s: float
    compute_s: float


def load_profile(model: str, profile_path: str = "") -> ComputeProfile:
    """The calibrated profile at `profile_path`, else the model's preset or estimate."""
    if profile_path:
        return ComputeProfile.load(profile_path)
    try:
        return compute_profile(model)
    except InvalidArgument:
        return ComputeProfile(model)


@dataclass(eq=False)
class Job:
    """Queued work: new tokens on top of a cache (batched), or a closure run alone."""

    cache: KvCache | None
    token_ids: list[int]
    fn: Callable[[], Any] | None
    future: asyncio.Future
    submitted_s: float
    done_tokens: int = 0
    started_s: float | None = None
    compute_s: float = 0.0
    running: bool = False
    withdrawn: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever the job is not in the running pass."""

    @property
    def finished(self) -> bool:
        """All its tokens computed (or its closure ran), without an error."""
        future = self.future
        return future.done() and not future.cancelled() and future.exception() is None

    def remaining_tokens(self) -> int:
        return len(self.token_ids) - self.done_tokens


@dataclass
class BatchCounts:
    """Counts of the passes run, for tests and metrics."""

    passes: int = 0
    sequences: int = 0
    tokens: int = 0
    max_sequences: int = 0


class ComputeQueue:
    """The batch loop: forward passes on one thread, queued work priced by the profile."""

    def __init__(
        self,
        model: Transformer,
        profile: ComputeProfile,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        metrics: Metrics | None = None,
    ) -> None:
        if max_batch_tokens <= 0:
            raise InvalidArgument("max_batch_tokens", f"must be > 0, got {max_batch_tokens}")
        self.model = model
        self.profile = profile
        self.max_batch_tokens = max_batch_tokens
        self.counts = BatchCounts()
        self.pace = PassPace()
        """Measured / profile seconds of the recent passes (the heartbeat's compute_factor)."""
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self._queue: list[Job] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        # Read by the heartbeat thread: plain values, replaced whole.
        self._depth = 0
        self._ahead_s = 0.0
        self._running: tuple[float, float] | None = None

    # -- load -------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Requests with work queued or running."""
        return self._depth

    @property
    def queued_work_s(self) -> float:
        """Estimated seconds until work submitted now would start: the rest of the
        running pass plus the passes the queued work fills ahead of it, at the pace this
        worker's recent passes ran."""
        factor = self.pace.factor
        total = self._ahead_s * factor
        running = self._running
        if running is not None:
            started, estimate = running
            total += max(0.0, estimate * factor - (time.monotonic() - started))
        return total

    def _plan(self) -> list[list[tuple[int, int]]]:
        """The queued forward work packed into passes as the loop will take them, each
        pass as (cached, new) segments."""
        work = [
            (job.cache.length, job.remaining_tokens())
            for job in self._queue
            if job.cache is not None and not job.running
        ]
        return pack(work, self.max_batch_tokens)

    def _account(self) -> None:
        self._depth = len(self._queue)
        passes = self._plan()
        if passes and sum(new for _, new in passes[-1]) < self.max_batch_tokens:
            passes.pop()  # new work joins the last pass, which has room left
        self._ahead_s = sum(self.profile.pass_s(p) for p in passes)

    # -- submitting -------------------------------------------------------------------

    def submit(self, cache: KvCache, token_ids: list[int]) -> Job:
        """Queue `token_ids` to be appended to `cache`; `wait` gives the logits of the
        last one. Call on the event loop."""
        # Refused here, alone, rather than failing the pass it would have joined.
        self.model.check_extend(cache.length, token_ids)
        job = Job(cache, list(token_ids), None, self._future(), time.monotonic())
        return self._enqueue(job)

    async def forward(self, cache: KvCache, token_ids: list[int]) -> Timed[torch.Tensor]:
        """Append `token_ids` to `cache` in the next passes; the last one's logits."""
        return await self.wait(self.submit(cache, token_ids))

    async def run(self, fn: Callable[[], T]) -> Timed[T]:
        """Run `fn` alone on the compute thread (work that is not a forward pass)."""
        context = contextvars.copy_context()
        job = Job(None, [], lambda: context.run(fn), self._future(), time.monotonic())
        return await self.wait(self._enqueue(job))

    async def wait(self, job: Job) -> Timed:
        """The job's result. Cancelled, it is withdrawn: when this returns or raises, the
        compute thread no longer touches its cache (a pass already running finishes)."""
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            await self.withdraw(job)
            raise

    async def withdraw(self, job: Job) -> None:
        """Take the job out of the queue, after the pass it is in (if any) ends."""
        job.withdrawn = True
        await job.idle.wait()
        self._remove(job)
        if not job.future.done():
            job.future.cancel()

    def _future(self) -> asyncio.Future:
        if self._closed:
            raise RuntimeError("the compute loop is closed")
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._loop(), name="compute-loop")
            self._task.add_done_callback(_loop_ended)
        return loop.create_future()

    def _enqueue(self, job: Job) -> Job:
        job.idle.set()
        self._queue.append(job)
        self._account()
        self._wake.set()
        return job

    def _remove(self, job: Job) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(job)
        self._account()

    # -- the loop ---------------------------------------------------------------------

    def _take(self) -> list[tuple[Job, int]]:
        """The next pass: a closure alone, or forward work in arrival order up to the
        token budget (the last one taken may be a chunk of its tokens)."""
        head = self._queue[0]
        if head.fn is not None:
            return [(head, 0)]
        batch: list[tuple[Job, int]] = []
        room = self.max_batch_tokens
        caches: set[int] = set()
        for job in self._queue:
            if job.fn is not None or job.withdrawn or id(job.cache) in caches:
                continue
            take = min(job.remaining_tokens(), room)
            batch.append((job, take))
            caches.add(id(job.cache))
            room -= take
            if not room:
                break
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            # Streams whose step just ended submit their next one as soon as they run:
            # let them, so that they join this pass.
            for _ in range(3):
                await asyncio.sleep(0)
            if not self._queue:  # its owners withdrew the work meanwhile
                continue
            batch = self._take()
            if not batch:  # only withdrawn work left, waiting for its owners
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            for job, _ in batch:
                job.running = True
                job.idle.clear()
                if job.started_s is None:
                    job.started_s = started
            segments = [(job.cache.length, take) for job, take in batch if job.cache is not None]
            estimate_s = self.profile.pass_s(segments)
            self._running = (started, estimate_s)
            self._account()
            try:
                outcome = await loop.run_in_executor(self._executor, self._compute, batch)
            finally:
                self._running = None
                for job, _ in batch:
                    job.running = False
                    job.idle.set()
            elapsed_s = time.monotonic() - started
            self.pace.observe(elapsed_s, estimate_s)
            self._settle(batch, outcome, elapsed_s)

    def _compute(self, batch: list[tuple[Job, int]]) -> dict[Job, Any]:
        """On the compute thread: each job's logits, closure value, or exception."""
        outcome: dict[Job, Any] = {}
        head, _ = batch[0]
        if head.fn is not None:
            try:
                outcome[head] = head.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the job's waiter
                outcome[head] = _Failed(exc)
            return outcome
        pieces: list[tuple[KvCache, Sequence[int]]] = []
        for job, take in batch:
            assert job.cache is not None, "a batched job has a cache"
            pieces.append((job.cache, job.token_ids[job.done_tokens : job.done_tokens + take]))
        try:
            outcome.update(
                zip((job for job, _ in batch), self.model.forward_batch(pieces), strict=True)
            )
        except Exception:  # noqa: BLE001 - one at a time, so only the bad one fails
            for (job, _), piece in zip(batch, pieces, strict=True):
                try:
                    outcome[job] = self.model.forward_batch([piece])[0]
                except Exception as exc:  # noqa: BLE001 - handed to the job's waiter
                    outcome[job] = _Failed(exc)
        return outcome

    def _settle(
        self, batch: list[tuple[Job, int]], outcome: dict[Job, Any], elapsed_s: float
    ) -> None:
        sequences = tokens = 0
        for job, take in batch:
            job.compute_s += elapsed_s
            result = outcome.get(job)
            if isinstance(result, _Failed):
                self._queue.remove(job)
                if not job.future.done():
                    job.future.set_exception(result.error)
                continue
            if job.cache is not None:
                job.done_tokens += take
                sequences += 1
                tokens += take
                if job.remaining_tokens():
                    continue
            self._queue.remove(job)
            if not job.future.done():
                assert job.started_s is not None, "a job that ran has started"
                job.future.set_result(Timed(result, job.started_s - job.submitted_s, job.compute_s))
        self._account()
        if sequences:
            self.counts.passes += 1
            self.counts.sequences += sequences
            self.counts.tokens += tokens
            self.counts.max_sequences = max(self.counts.max_sequences, sequences)
            if self._metrics is not None:
                self._metrics.worker_batch_sequences.observe(sequences)
                self._metrics.worker_batch_tokens.observe(tokens)

    def close(self) -> None:
        """Stop taking work; a pass already running finishes on its own."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        for job in self._queue:
            if not job.future.done():
                job.future.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _loop_ended(task: asyncio.Task) -> None:
    """Nothing would compute any more: say why, loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error("compute loop died", exc_info=task.exception())


@dataclass(frozen=True)
class _Failed:
    error: BaseException
