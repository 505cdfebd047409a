"""The compute thread: every forward pass runs there, off the event loop, in arrival order.

One thread, because a CPU worker gains nothing from running two forward passes at once
(they would share the same cores) and a single queue makes the waiting time W(x) that
gossip reports an honest sum: the estimated seconds of every pass queued or running.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvrs.errors import InvalidArgument
from kvrs.profile import ComputeProfile, DecodeProfile, compute_profile, decode_profile

T = TypeVar("T")


@dataclass(frozen=True)
class Timed(Generic[T]):
    """A forward pass's result with the time it waited and the time it ran."""

    value: T
    queued_s: float
    compute_s: float


class Estimates:
    """Predicted seconds of each kind of pass, from a calibrated or preset profile."""

    def __init__(self, model: str, profile_path: str = "") -> None:
        self.compute: ComputeProfile = (
            ComputeProfile.load(profile_path) if profile_path else _preset(compute_profile, model)
        )
        self.decode: DecodeProfile | None = _preset(decode_profile, model, required=False)

    def prefill_s(self, tokens: int) -> float:
        return self.compute.prefill_s(tokens)

    def extend_s(self, cached_tokens: int, new_tokens: int) -> float:
        return self.compute.extend_s(cached_tokens, new_tokens)

    def step_s(self, context_tokens: int) -> float:
        if self.decode is not None:
            return self.decode.step_s(1, context_tokens)
        return self.compute.extend_s(context_tokens, 1)


def _preset(lookup, model: str, required: bool = True):
    try:
        return lookup(model)
    except InvalidArgument:
        if required:
            return ComputeProfile(model)
        return None


class ComputeQueue:
    """Runs forward passes on one thread and knows how much work is queued."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self._ids = itertools.count()
        self._pending: dict[int, float] = {}
        self._running: tuple[int, float] | None = None

    @property
    def depth(self) -> int:
        """Passes queued or running."""
        return len(self._pending)

    @property
    def queued_work_s(self) -> float:
        """Estimated seconds until a pass submitted now would start."""
        total = sum(self._pending.values())
        running = self._running
        if running is not None and running[0] in self._pending:
            elapsed = time.monotonic() - running[1]
            total -= min(elapsed, self._pending[running[0]])
        return max(0.0, total)

    async def run(self, fn: Callable[[], T], estimate_s: float) -> Timed[T]:
        """Run `fn` on the compute thread; the event loop stays free meanwhile."""
        job = next(self._ids)
        self._pending[job] = estimate_s
        submitted = time.monotonic()

        def work() -> tuple[T, float, float]:
            started = time.monotonic()
            self._running = (job, started)
            value = fn()
            return value, started, time.monotonic()

        context = contextvars.copy_context()
        try:
            loop = asyncio.get_running_loop()
            value, started, finished = await loop.run_in_executor(self._executor, context.run, work)
        finally:
            self._pending.pop(job, None)
        return Timed(value, started - submitted, finished - started)

    def close(self) -> None:
        """Stop taking work; a pass already running finishes on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
