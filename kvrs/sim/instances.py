"""Prefill and decode executors: token-budget prefill batches, continuous-batching decode.

Prefill: requests queue FIFO; a batch takes requests while their new tokens fit the
token budget (a longer prompt runs alone) and lasts `a + Σ (T_ext(hit_i, new_i) − a)`,
i.e. `a + b·Σ new + c·Σ (L² − hit²)` for the fitted profile. Prefix blocks found in the
node's LRU pool are not recomputed.

Decode: continuous batching. A step lasts `a + b·Σ context + c·B`; while the batch does
not change, the context grows by B tokens per step, so step times form an arithmetic
series and a whole run of steps up to the next completion is one event. An arrival,
a compute job or a failure cuts the run at the end of the step in progress. KV memory
is reserved (prompt + output) before the KV is pulled, so a full instance makes new
requests wait for memory instead of evicting running ones.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvrs.profile import ComputeProfile, DecodeProfile
from kvrs.sim.cache import PrefixCache
from kvrs.sim.engine import EventLoop
from kvrs.sim.metrics import RequestRecord


def _ignore(instance_id: str) -> None:
    """The default change hook: nobody is sampling this instance."""


class PrefillJob:
    """Prompt tokens to turn into KV on a prefill instance; `on_start(job, end_s)` when
    its batch starts (if set), `on_done(job)` at batch end."""

    __slots__ = (
        "record",
        "tokens",
        "hash_ids",
        "on_done",
        "on_start",
        "hit_tokens",
        "estimate_s",
        "started_s",
        "tag",
        "prefill_id",
    )

    def __init__(
        self,
        record: RequestRecord,
        tokens: int,
        hash_ids: Sequence[int],
        on_done: Callable[[PrefillJob], Any],
        tag: Any = None,
        on_start: Callable[[PrefillJob, float], Any] | None = None,
    ) -> None:
        self.record = record
        self.tokens = tokens
        self.hash_ids = hash_ids
        self.on_done = on_done
        self.on_start = on_start
        self.hit_tokens = 0
        self.estimate_s = 0.0
        self.started_s = math.nan
        self.tag = tag
        self.prefill_id = ""


class PrefillInstance:
    """One prefill instance: a FIFO queue, token-budget batches, a prefix pool."""

    def __init__(
        self,
        instance_id: str,
        node: str,
        loop: EventLoop,
        profile: ComputeProfile,
        pool: PrefixCache,
        block_tokens: int,
        budget_tokens: int,
    ) -> None:
        self.instance_id = instance_id
        self.node = node
        self.loop = loop
        self.profile = profile
        self.pool = pool
        self.block_tokens = block_tokens
        self.budget_tokens = budget_tokens
        self.queue: deque[PrefillJob] = deque()
        self.batch: list[PrefillJob] = []
        self.busy_until_s = 0.0
        self.queued_work_s = 0.0
        self.alive = True
        self.busy_s = 0.0
        self._handle = 0
        self._ending = False
        self.on_change: Callable[[str], Any] = _ignore  # telemetry keeps the prior state
        self.pool_shared = False  # other instances insert into the same prefix pool

    def hit_tokens(self, hash_ids: Sequence[int], tokens: int) -> int:
        """Prompt tokens the pool holds now; at least one token is always computed."""
        hit = self.pool.leading_hits(hash_ids) * self.block_tokens
        return max(0, min(hit, tokens - 1))

    def estimate_s(self, hit_tokens: int, tokens: int) -> float:
        return self.profile.extend_s(hit_tokens, tokens - hit_tokens)

    def wait_s(self, now_s: float) -> float:
        """W(p): the batch in progress plus the estimated work queued behind it."""
        return max(0.0, self.busy_until_s - now_s) + self.queued_work_s

    def submit(self, job: PrefillJob) -> None:
        self.on_change(self.instance_id)
        job.estimate_s = self.estimate_s(self.hit_tokens(job.hash_ids, job.tokens), job.tokens)
        self.queued_work_s += job.estimate_s
        self.queue.append(job)
        if not self.batch and not self._ending:
            self._start_batch()

    def _start_batch(self) -> None:
        if not self.queue or not self.alive:
            return
        self.on_change(self.instance_id)
        now_s = self.loop.now_s
        batch: list[PrefillJob] = []
        tokens = 0
        a_s = self.profile.a_s
        duration_s = a_s
        while self.queue:
            job = self.queue[0]
            hit = self.hit_tokens(job.hash_ids, job.tokens)
            new = job.tokens - hit
            if batch and tokens + new > self.budget_tokens:
                break
            self.queue.popleft()
            self.queued_work_s = max(0.0, self.queued_work_s - job.estimate_s)
            job.hit_tokens = hit
            job.started_s = now_s
            job.prefill_id = self.instance_id
            batch.append(job)
            tokens += new
            duration_s += self.profile.extend_s(hit, new) - a_s
        self.batch = batch
        self.busy_until_s = now_s + duration_s
        self.busy_s += duration_s
        self._handle = self.loop.at(self.busy_until_s, self._end_batch)
        for job in batch:
            if job.on_start is not None:
                job.on_start(job, self.busy_until_s)

    def _end_batch(self) -> None:
        self._handle = 0
        self.on_change(self.instance_id)
        batch, self.batch = self.batch, []
        now_s = self.loop.now_s
        for job in batch:
            self.pool.insert(job.hash_ids, now_s)
        # Callbacks may submit more work here; the next batch starts once, after them.
        self._ending = True
        for job in batch:
            job.on_done(job)
        self._ending = False
        self._start_batch()

    def fail(self) -> list[PrefillJob]:
        """Stop; return every job queued or in progress (their work is lost)."""
        self.on_change(self.instance_id)
        self.alive = False
        self.loop.cancel(self._handle)
        self._handle = 0
        lost = self.batch + list(self.queue)
        self.batch = []
        self.queue.clear()
        self.queued_work_s = 0.0
        self.busy_until_s = self.loop.now_s
        return lost


class DecodeMember:
    """A request on a decode instance: its KV context and the tokens it still owes."""

    __slots__ = (
        "record",
        "context_tokens",
        "left_tokens",
        "reserved_tokens",
        "on_resume",
        "hash_ids",
    )

    def __init__(
        self,
        record: RequestRecord,
        context_tokens: int,
        left_tokens: int,
        reserved_tokens: int,
        hash_ids: Sequence[int] = (),
        on_resume: Callable[[DecodeMember, float], Any] | None = None,
    ) -> None:
        self.record = record
        self.context_tokens = context_tokens
        self.left_tokens = left_tokens
        self.reserved_tokens = reserved_tokens
        self.hash_ids = hash_ids
        self.on_resume = on_resume  # (member, time) at its first token on this instance


class ComputeJob:
    """Work a decode instance runs between steps (extend, or HYBRID's recomputed part)."""

    __slots__ = ("duration_s", "on_done", "tag")

    def __init__(
        self, duration_s: float, on_done: Callable[[ComputeJob], Any], tag: Any = None
    ) -> None:
        self.duration_s = duration_s
        self.on_done = on_done
        self.tag = tag


class DecodeInstance:
    """One decode instance: KV memory, a running batch and jobs that pause it."""

    def __init__(
        self,
        instance_id: str,
        node: str,
        loop: EventLoop,
        profile: DecodeProfile,
        kv_capacity_tokens: int,
        max_batch: int,
        cache: PrefixCache,
        on_finish: Callable[[DecodeMember], Any],
    ) -> None:
        self.instance_id = instance_id
        self.node = node
        self.loop = loop
        self.profile = profile
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_batch = max_batch
        self.cache = cache
        self.on_finish = on_finish
        self.reserved_tokens = 0
        self.memory_queue: deque[tuple[int, Callable[[], Any], Any]] = deque()
        self.batch: list[DecodeMember] = []
        self.waiting: deque[DecodeMember] = deque()
        self.jobs: deque[ComputeJob] = deque()
        self.job_backlog_s = 0.0
        self.alive = True
        self.steps = 0
        # The run of steps in progress.
        self._running = False
        self._seg_start_s = 0.0
        self._seg_base_s = 0.0
        self._seg_inc_s = 0.0
        self._seg_planned = 0
        self._seg_cut = False
        self._handle = 0
        self._job_until_s = 0.0
        self._ending = False  # inside a boundary's callbacks: the boundary continues
        self.context_tokens = 0  # Σ context of the batch
        self.on_change: Callable[[str], Any] = _ignore  # telemetry keeps the prior state

    # -- memory -------------------------------------------------------------------------

    @property
    def free_kv_tokens(self) -> int:
        return self.kv_capacity_tokens - self.reserved_tokens

    def request_memory(self, tokens: int, granted: Callable[[], Any], tag: Any = None) -> bool:
        """Reserve `tokens` of KV now, or queue until enough frees; `granted()` then runs."""
        self.on_change(self.instance_id)
        if not self.memory_queue and tokens <= self.free_kv_tokens:
            self.reserved_tokens += tokens
            granted()
            return True
        self.memory_queue.append((tokens, granted, tag))
        return False

    def release_memory(self, tokens: int) -> None:
        self.on_change(self.instance_id)
        self.reserved_tokens -= tokens
        while self.memory_queue and self.alive:
            need, granted, _ = self.memory_queue[0]
            if need > self.free_kv_tokens and self.reserved_tokens > 0:
                break
            self.memory_queue.popleft()
            self.reserved_tokens += need
            granted()

    def cancel_memory_request(self, tag: Any) -> bool:
        """Withdraw a queued reservation (its request is being recovered elsewhere)."""
        self.on_change(self.instance_id)
        for i, (_, _, queued_tag) in enumerate(self.memory_queue):
            if queued_tag is tag:
                del self.memory_queue[i]
                return True
        return False

    # -- load, as telemetry reports it ---------------------------------------------------

    def step_now_s(self, extra_batch: int = 0, extra_context: int = 0) -> float:
        return self.profile.step_s(
            len(self.batch) + extra_batch, self.context_tokens + extra_context
        )

    def job_running(self, at_s: float) -> bool:
        """A job pauses the batch at `at_s` (W(d) then shrinks as time passes)."""
        return self._job_until_s > at_s

    def wait_s(self, now_s: float) -> float:
        """W(d): jobs ahead, the step in progress, and the wait for KV memory if any."""
        wait = self.job_backlog_s + max(0.0, self._job_until_s - now_s)
        wait += self.step_now_s(extra_batch=1)
        if self.memory_queue:
            wait += self._memory_wait_s()
        return wait

    def _memory_wait_s(self) -> float:
        """Time until running requests free the memory the queued ones need."""
        need = sum(tokens for tokens, _, _ in self.memory_queue) - self.free_kv_tokens
        step_s = self.step_now_s()
        freed = 0
        for member in sorted(self.batch, key=lambda m: m.left_tokens):
            freed += member.reserved_tokens
            if freed >= need:
                return member.left_tokens * step_s
        longest = max((m.left_tokens for m in self.batch), default=0)
        return longest * step_s

    # -- batch ---------------------------------------------------------------------------

    def admit(self, member: DecodeMember) -> None:
        """The member's KV is here: it joins the batch at the next step boundary."""
        self.on_change(self.instance_id)
        self.cache.insert(member.hash_ids, self.loop.now_s)
        self.waiting.append(member)
        self._kick()

    def add_job(self, job: ComputeJob) -> None:
        """Run `job` at the next step boundary, pausing the batch for its duration."""
        self.on_change(self.instance_id)
        self.jobs.append(job)
        self.job_backlog_s += job.duration_s
        self._kick()

    def _kick(self) -> None:
        if not self.alive or self._ending:
            return
        if self._running:
            self._cut()
        elif not self._handle:
            self._boundary()

    def _steps_done_by(self, elapsed_s: float) -> int:
        """Whole steps of the current run finished `elapsed_s` after it started."""
        base, inc = self._seg_base_s, self._seg_inc_s
        if elapsed_s <= 0:
            return 0
        if inc <= 0:
            n = int(elapsed_s / base) if base > 0 else self._seg_planned
        else:
            half = base - inc / 2
            n = int((-half + math.sqrt(half * half + 2 * inc * elapsed_s)) / inc)
        n = max(0, min(n, self._seg_planned))
        while n < self._seg_planned and self._run_s(n + 1) <= elapsed_s:
            n += 1
        while n > 0 and self._run_s(n) > elapsed_s:
            n -= 1
        return n

    def _run_s(self, steps: int) -> float:
        return steps * self._seg_base_s + self._seg_inc_s * steps * (steps - 1) / 2

    def _cut(self) -> None:
        """End the run at the end of the step in progress (the batch is about to change)."""
        if self._seg_cut:
            return
        done = self._steps_done_by(self.loop.now_s - self._seg_start_s)
        steps = min(done + 1, self._seg_planned)
        if steps < self._seg_planned:
            self.loop.cancel(self._handle)
            self._handle = self.loop.at(
                self._seg_start_s + self._run_s(steps), self._end_run, steps
            )
        self._seg_cut = True

    def _start_run(self) -> None:
        batch = self.batch
        size = len(batch)
        now_s = self.loop.now_s
        self._seg_start_s = now_s
        self._seg_base_s = self.profile.step_s(size, self.context_tokens)
        self._seg_inc_s = self.profile.b_s_per_context_token * size
        self._seg_planned = min(m.left_tokens for m in batch)
        self._seg_cut = False
        self._running = True
        self._handle = self.loop.at(
            now_s + self._run_s(self._seg_planned), self._end_run, self._seg_planned
        )

    def _end_run(self, steps: int) -> None:
        self.on_change(self.instance_id)
        self._handle = 0
        self._running = False
        self._ending = True
        self._advance(steps)
        self._ending = False
        self._boundary()

    def _advance(self, steps: int) -> None:
        """Credit `steps` steps of the current run to every member; finish the done ones."""
        if steps <= 0:
            return
        start_s, base, inc = self._seg_start_s, self._seg_base_s, self._seg_inc_s
        end_s = start_s + self._run_s(steps)
        self.steps += steps
        finished: list[DecodeMember] = []
        kept: list[DecodeMember] = []
        for member in self.batch:
            record = member.record
            if record.generated_tokens == 0:
                record.first_token_s = start_s + base
                if steps > 1:
                    record.segments.append((0.0, base + inc, inc, steps - 1))
            else:
                record.segments.append((start_s - record.last_token_s, base, inc, steps))
            if member.on_resume is not None:
                resume, member.on_resume = member.on_resume, None
                resume_s = start_s + base
                resume(member, resume_s)
            record.generated_tokens += steps
            record.last_token_s = end_s
            member.context_tokens += steps
            member.left_tokens -= steps
            (finished if member.left_tokens <= 0 else kept).append(member)
        self.context_tokens += steps * len(self.batch)
        if finished:
            self.batch = kept
            for member in finished:
                self.context_tokens -= member.context_tokens
            for member in finished:
                self.release_memory(member.reserved_tokens)
                self.on_finish(member)

    def _boundary(self) -> None:
        """Between steps: run one queued job, else admit arrivals and start the next run."""
        self.on_change(self.instance_id)
        if not self.alive:
            return
        now_s = self.loop.now_s
        if self.jobs:
            job = self.jobs.popleft()
            self.job_backlog_s = max(0.0, self.job_backlog_s - job.duration_s)
            self._job_until_s = now_s + job.duration_s
            self._handle = self.loop.at(self._job_until_s, self._job_done, job)
            return
        while self.waiting and len(self.batch) < self.max_batch:
            member = self.waiting.popleft()
            self.batch.append(member)
            self.context_tokens += member.context_tokens
        if self.batch:
            self._start_run()

    def _job_done(self, job: ComputeJob) -> None:
        self.on_change(self.instance_id)
        self._handle = 0
        self._ending = True
        job.on_done(job)
        self._ending = False
        self._boundary()

    def fail(self) -> list[DecodeMember]:
        """Stop now; credit the steps already finished and return the members left."""
        self.on_change(self.instance_id)
        self.alive = False
        self.loop.cancel(self._handle)
        self._handle = 0
        if self._running:
            self._running = False
            self._advance(self._steps_done_by(self.loop.now_s - self._seg_start_s))
        members = self.batch + list(self.waiting)
        self.batch = []
        self.waiting.clear()
        self.jobs.clear()
        self.job_backlog_s = 0.0
        self.memory_queue.clear()
        self.reserved_tokens = 0
        self.context_tokens = 0
        return members
