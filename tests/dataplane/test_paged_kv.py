"""Paged KV on the embedded model: sequences over blocks, prefix blocks shared (not copied)
and written only by their one holder, blocks back in the pool however a cache ends."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from kvrs.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted
from kvrs.tokenizer import encode, prefix_block_hashes
from services.worker.model import Transformer
from services.worker.paged_kv import FillProgress, KvPool

PROMPT = encode("Paged KV: a sequence is a table of blocks, and prompts share their prefixes.")
BLOCK = 8
TIGHT = {"rtol": 1e-12, "atol": 1e-12}


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.load("tiny")


@pytest.fixture
def pool(tiny) -> KvPool:
    return tiny.new_pool(num_blocks=32, block_tokens=BLOCK)


def assert_same_kv(a, b) -> None:
    for (ka, va), (kb, vb) in zip(a, b, strict=True):
        torch.testing.assert_close(ka, kb, **TIGHT)
        torch.testing.assert_close(va, vb, **TIGHT)


def test_a_sequence_over_many_blocks_equals_the_contiguous_prefill(tiny, pool):
    contiguous = tiny.new_pool(1, len(PROMPT) + 16).new_cache()  # one block: no paging
    reference, reference_logits = tiny.prefill(PROMPT, contiguous)
    cache, logits = tiny.prefill(PROMPT, pool.new_cache())
    assert len(cache.blocks) == -(-len(PROMPT) // BLOCK) > 4
    torch.testing.assert_close(logits, reference_logits, **TIGHT)
    assert_same_kv(cache.layers_kv(), reference.layers_kv())
    first = int(torch.argmax(logits))
    assert tiny.greedy(cache, first, 12) == tiny.greedy(reference, first, 12)


def test_pages_are_the_blocks_themselves(tiny, pool):
    cache, _ = tiny.prefill(PROMPT, pool.new_cache())
    pages = cache.pages(5, 30)
    assert [(start, end) for start, end, _ in pages] == [(5, 8), (8, 16), (16, 24), (24, 30)]
    _, _, layers = pages[1]
    key, _ = layers[0]
    assert key.is_contiguous() and key.shape == (8, 2, 16)
    key.fill_(7.0)  # a transfer receives into these views in place
    assert torch.all(cache.gather(0)[0][8:16] == 7.0)


def test_a_prompt_shares_the_resident_blocks_of_its_prefix(tiny, pool):
    owner, owner_logits = tiny.prefill(PROMPT, pool.new_cache())
    owner.publish(prefix_block_hashes(PROMPT, BLOCK))
    hashes = prefix_block_hashes(PROMPT[:30], BLOCK)
    shared = pool.lookup(hashes)
    assert shared == owner.blocks[:3]
    before = pool.available_blocks()
    sharer = pool.new_cache(shared=shared)
    assert sharer.length == 24 and pool.available_blocks() == before, "shared, not copied"
    _, logits = tiny.extend(sharer, PROMPT[24:])
    torch.testing.assert_close(logits, owner_logits, **TIGHT)
    assert_same_kv(sharer.layers_kv(), owner.layers_kv())


def test_a_holder_never_writes_into_a_block_another_shares(tiny, pool):
    owner, _ = tiny.prefill(PROMPT[:24], pool.new_cache())
    owner.publish(prefix_block_hashes(PROMPT[:24], BLOCK))
    sharer = pool.new_cache(shared=owner.blocks[:3])
    kept = sharer.layers_kv()
    owner.truncate(20)  # back into its last block, which the sharer holds too
    tiny.extend(owner, [5, 6, 7, 8])
    assert owner.blocks[2] != sharer.blocks[2], "the owner wrote into a copy of its own"
    assert_same_kv(sharer.layers_kv(), kept)
    reference, _ = tiny.prefill([*PROMPT[:20], 5, 6, 7, 8])
    assert_same_kv(owner.layers_kv(), reference.layers_kv())


def test_blocks_go_back_to_the_pool_on_free_and_when_a_cache_is_dropped(tiny, pool):
    full = pool.available_blocks()
    kept, _ = tiny.prefill(PROMPT, pool.new_cache())
    dropped, _ = tiny.prefill(PROMPT, pool.new_cache())
    assert pool.available_blocks() == full - 2 * len(kept.blocks)
    kept.free()
    del dropped
    gc.collect()
    assert pool.available_blocks() == full


def test_a_worker_pool_is_bounded_and_a_scratch_pool_grows(tiny):
    bounded = tiny.new_pool(num_blocks=2, block_tokens=BLOCK)
    with pytest.raises(ResourceExhausted, match="needs 3 KV blocks, 2 of 2 available"):
        bounded.new_cache(3 * BLOCK)
    assert bounded.available_blocks() == 2
    scratch = tiny.new_pool(num_blocks=0, block_tokens=BLOCK, growable=True)
    cache, _ = tiny.prefill(PROMPT, scratch.new_cache())
    assert scratch.num_blocks >= len(cache.blocks)


def test_a_fill_lets_each_layer_be_read_once_written_and_fails_its_waiters(tiny, pool):
    cache = pool.new_cache(len(PROMPT))
    cache.filling = FillProgress(tiny.config.layers, 0, len(PROMPT))
    with pytest.raises(DeadlineExceeded, match="layer 0"):
        cache.filling.wait(0, 8, timeout_s=0.01)
    tiny.forward_batch([(cache, PROMPT)])  # writes every layer: the waits return at once
    for layer in range(tiny.config.layers):
        cache.filling.wait(layer, len(PROMPT), timeout_s=0.01)
    failing = FillProgress(tiny.config.layers, 0, len(PROMPT))
    errors: list[Exception | None] = []
    waiter = threading.Thread(target=lambda: errors.append(_wait_error(failing)))
    waiter.start()
    failing.fail("the pass raised")
    waiter.join(10)
    assert isinstance(errors[0], FailedPrecondition) and "the pass raised" in str(errors[0])


def _wait_error(progress: FillProgress) -> Exception | None:
    try:
        progress.wait(1, 4, timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - handed to the test
        return exc
    return None
