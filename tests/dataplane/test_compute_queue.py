"""The compute loop's books: queued work priced as the passes it will run, work longer
than a pass chunked, results equal to the model run directly."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvrs.profile import BatchCost, ComputeProfile
from services.worker.compute import ComputeQueue
from services.worker.model import Transformer

COST = BatchCost(a_s=1.0, b_s_per_token=0.01, c_s_per_token2=1e-4, d_s_per_sequence=0.1)


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.load("tiny")


async def test_queued_work_is_the_passes_ahead_priced_by_the_batch_cost(tiny):
    queue = ComputeQueue(tiny, ComputeProfile("tiny", batch=COST), max_batch_tokens=64)
    started, gate = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        gate.wait()

    try:
        blocker = asyncio.ensure_future(queue.run(block))
        await asyncio.to_thread(started.wait)
        prompts = [[(7 * p + i) % 250 for i in range(40)] for p in range(3)]
        caches = [tiny.new_cache() for _ in prompts]
        jobs = [queue.submit(cache, prompt) for cache, prompt in zip(caches, prompts, strict=True)]
        assert queue.depth == 4
        # 120 tokens at 64 a pass: [40, 24 of the second], then [its last 16, 40] — the
        # last pass has room, so new work would join it: only the first is ahead.
        assert queue.queued_work_s == pytest.approx(COST.batch_s([(0, 40), (0, 24)]))
        gate.set()
        await blocker
        results = [await queue.wait(job) for job in jobs]
        assert queue.depth == 0
        assert queue.queued_work_s == 0.0
    finally:
        gate.set()
        queue.close()
    for prompt, result in zip(prompts, results, strict=True):
        torch.testing.assert_close(result.value, tiny.prefill(prompt)[1], rtol=1e-12, atol=1e-12)
    # The second prompt was computed in two chunks, in two passes.
    assert queue.counts.passes == 2
    assert queue.counts.tokens == 120
    assert queue.counts.max_sequences == 2


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
