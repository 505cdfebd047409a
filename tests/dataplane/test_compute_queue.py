"""The compute loop's books: queued work priced as the passes it will run, at the pace
the recent passes ran, work longer than a pass chunked, results equal to the model run
directly."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvrs.profile import BatchCost, ComputeProfile
from services.worker.compute import ComputeQueue
from services.worker.model import Transformer
from services.worker.pace import MAX_FACTOR, MIN_PASSES, PassPace

COST = BatchCost(a_s=1.0, b_s_per_token=0.01, c_s_per_token2=1e-4, d_s_per_sequence=0.1)


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.load("tiny")


class Blocker:
    """Work that holds the queue's compute thread until released, so that what is
    submitted meanwhile stays queued."""

    def __init__(self) -> None:
        self.started, self.gate = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.started.set()
        self.gate.wait()

    async def hold(self, queue: ComputeQueue) -> asyncio.Future:
        """Runs on the compute thread from now on; the future of its end."""
        running = asyncio.ensure_future(queue.run(self))
        await asyncio.to_thread(self.started.wait)
        return running


async def test_queued_work_is_the_passes_ahead_priced_by_the_batch_cost(tiny):
    queue = ComputeQueue(tiny, ComputeProfile("tiny", batch=COST), max_batch_tokens=64)
    block = Blocker()
    try:
        blocker = await block.hold(queue)
        prompts = [[(7 * p + i) % 250 for i in range(40)] for p in range(3)]
        caches = [tiny.new_cache() for _ in prompts]
        jobs = [queue.submit(cache, prompt) for cache, prompt in zip(caches, prompts, strict=True)]
        assert queue.depth == 4
        # 120 tokens at 64 a pass: [40, 24 of the second], then [its last 16, 40] — the
        # last pass has room, so new work would join it: only the first is ahead.
        assert queue.queued_work_s == pytest.approx(COST.batch_s([(0, 40), (0, 24)]))
        block.gate.set()
        await blocker
        results = [await queue.wait(job) for job in jobs]
        assert queue.depth == 0
        assert queue.queued_work_s == 0.0
    finally:
        block.gate.set()
        queue.close()
    for prompt, result in zip(prompts, results, strict=True):
        torch.testing.assert_close(result.value, tiny.prefill(prompt)[1], rtol=1e-12, atol=1e-12)
    # The second prompt was computed in two chunks, in two passes.
    assert queue.counts.passes == 2
    assert queue.counts.tokens == 120
    assert queue.counts.max_sequences == 2


def test_the_pace_is_the_median_ratio_of_the_recent_passes_within_the_band():
    pace = PassPace(window=16, min_passes=4)
    for measured_s in (0.02, 0.03):
        pace.observe(measured_s, 0.01)
    assert pace.factor == 1.0 and not pace.measured  # too few passes to say
    for measured_s in (0.03, 0.03, 5.0):  # one pass stalled for seconds
        pace.observe(measured_s, 0.01)
    assert pace.factor == pytest.approx(3.0) and pace.measured
    pace.observe(0.0, 0.01)  # nothing measured, or nothing estimated: not a sample
    pace.observe(0.02, 0.0)
    assert pace.passes == 5
    for _ in range(16):
        pace.observe(1.0, 1e-6)
    assert pace.factor == MAX_FACTOR


async def test_queued_work_is_reported_at_the_pace_the_passes_ran(tiny):
    """A profile far faster than the passes really run: once enough passes were timed,
    the queued work is reported at their measured pace (clipped to the band)."""
    fast = BatchCost(a_s=1e-9, b_s_per_token=1e-12, c_s_per_token2=0.0, d_s_per_sequence=0.0)
    queue = ComputeQueue(tiny, ComputeProfile("tiny", batch=fast), max_batch_tokens=64)
    block = Blocker()
    try:
        for i in range(MIN_PASSES):
            await queue.forward(tiny.new_cache(), [i + 1, i + 2])
        assert queue.pace.factor == MAX_FACTOR
        blocker = await block.hold(queue)
        prompts = [[(5 * p + i) % 250 for i in range(40)] for p in range(2)]
        jobs = [queue.submit(tiny.new_cache(), prompt) for prompt in prompts]
        assert queue.queued_work_s == pytest.approx(MAX_FACTOR * fast.batch_s([(0, 40), (0, 24)]))
        block.gate.set()
        await blocker
        for job in jobs:
            await queue.wait(job)
    finally:
        block.gate.set()
        queue.close()


async def test_a_withdrawn_job_never_touches_its_cache(tiny):
    queue = ComputeQueue(tiny, ComputeProfile("tiny"), max_batch_tokens=64)
    gate = threading.Event()
    try:
        blocker = asyncio.ensure_future(queue.run(gate.wait))
        await asyncio.sleep(0.05)
        cache = tiny.new_cache()
        waiter = asyncio.ensure_future(queue.forward(cache, [1, 2, 3]))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.set()
        await blocker
        await queue.forward(tiny.new_cache(), [4])
    finally:
        gate.set()
        queue.close()
    assert cache.length == 0
    assert queue.depth == 0


async def test_work_withdrawn_while_the_loop_gathers_its_pass_leaves_the_loop_computing(tiny):
    """The loop yields a few times before it takes a pass (so streams can join it); work
    withdrawn in between leaves the queue empty there. That once killed the loop
    (IndexError), and with it every later request on the worker."""
    queue = ComputeQueue(tiny, ComputeProfile("tiny"), max_batch_tokens=64)
    try:
        job = queue.submit(tiny.new_cache(), [1, 2, 3])
        await asyncio.sleep(0)  # the loop sees the job and starts gathering its pass
        await queue.withdraw(job)
        for _ in range(5):
            await asyncio.sleep(0)  # the loop takes its pass from the empty queue
        cache = tiny.new_cache()
        result = await asyncio.wait_for(queue.forward(cache, [4, 5]), timeout=10)
    finally:
        queue.close()
    torch.testing.assert_close(result.value, tiny.prefill([4, 5])[1], rtol=1e-12, atol=1e-12)
    assert cache.length == 2
