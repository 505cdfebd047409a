"""The KV block bookkeeping: allocation, shared references, prefix hashes, LRU reuse."""

from __future__ import annotations

import pytest

from kvrs.block_manager import BlockManager
from kvrs.errors import InvalidArgument, ResourceExhausted
from kvrs.tokenizer import prefix_block_hashes


def test_a_prompt_finds_only_the_resident_blocks_at_its_start():
    blocks = BlockManager(8)
    shared = list(range(100))
    first = prefix_block_hashes([*shared, 1, 2, 3, 4], 25)
    table = blocks.allocate(len(first))
    for block, block_hash in zip(table, first, strict=True):
        assert blocks.publish(block, block_hash)
    second = prefix_block_hashes([*shared, 9, 9, 9, 9], 25)
    assert blocks.lookup(second) == table[:4]  # the 100 shared tokens, not the tail
    other = prefix_block_hashes([7, *shared[1:]], 25)
    assert blocks.lookup(other) == []  # chained: a different first block misses all


def test_a_shared_block_lives_until_its_last_holder_releases_it():
    blocks = BlockManager(4)
    (block,) = blocks.allocate(1)
    blocks.publish(block, 0xAB)
    blocks.share([block])
    assert blocks.refs(block) == 2 and blocks.used_blocks == 1
    blocks.release([block])
    assert blocks.refs(block) == 1 and blocks.cached_blocks == 0
    blocks.release([block])
    # Unreferenced but published: cached, still found, and available to allocations.
    assert blocks.cached_blocks == 1 and blocks.available_blocks == 4
    assert blocks.lookup([0xAB]) == [block]
    blocks.share([block])  # a later prompt takes it back out of the cache
    assert blocks.cached_blocks == 0 and blocks.refs(block) == 1


def test_allocation_takes_free_blocks_first_then_the_least_recently_used_cached():
    blocks = BlockManager(4)
    table = blocks.allocate(3)
    for block, block_hash in zip(table, (1, 2, 3), strict=True):
        blocks.publish(block, block_hash)
    blocks.release([table[1]])
    blocks.release([table[0]])  # cached after table[1]: more recently used
    assert blocks.free_blocks == 1 and blocks.cached_blocks == 2
    (fresh,) = blocks.allocate(1)
    assert fresh not in table, "a free block goes before any cached one"
    (reused,) = blocks.allocate(1)
    assert reused == table[1] and blocks.lookup([2]) == [], "its hash is forgotten"
    assert blocks.lookup([1]) == [table[0]]
    assert blocks.hash_of(reused) is None


def test_a_referenced_block_is_never_taken_and_a_short_pool_takes_nothing():
    blocks = BlockManager(3)
    held = blocks.allocate(2)
    with pytest.raises(ResourceExhausted, match="needs 2 KV blocks, 1 of 3 available"):
        blocks.allocate(2)
    assert blocks.free_blocks == 1, "a refused allocation takes nothing"
    blocks.release(held)
    assert sorted(blocks.allocate(3)) == [0, 1, 2]


def test_the_first_copy_of_a_prefix_stays_the_shared_one():
    blocks = BlockManager(4)
    first, second = blocks.allocate(2)
    assert blocks.publish(first, 7)
    assert not blocks.publish(second, 7), "the hash already names a block"
    assert not blocks.publish(first, 8), "the block already carries a hash"
    assert blocks.lookup([7]) == [first] and blocks.hash_of(second) is None
    blocks.unpublish(first)  # its owner rewrites it
    assert blocks.lookup([7]) == [] and blocks.hashes() == []


def test_hashes_list_the_most_recently_used_first():
    blocks = BlockManager(3)
    table = blocks.allocate(3)
    for block, block_hash in zip(table, (10, 20, 30), strict=True):
        blocks.publish(block, block_hash)
    blocks.share([table[0]])
    assert blocks.hashes() == [10, 30, 20]
    assert blocks.hashes(limit=2) == [10, 30]


def test_misuse_is_refused_by_name():
    blocks = BlockManager(2)
    with pytest.raises(InvalidArgument, match="block 0 is not in use"):
        blocks.release([0])
    with pytest.raises(InvalidArgument, match="holds nothing to share"):
        blocks.share([1])
    with pytest.raises(InvalidArgument, match="outside"):
        blocks.refs(2)
    with pytest.raises(InvalidArgument, match="not in use"):
        blocks.publish(0, 5)


def test_a_pool_grows_with_new_free_blocks():
    blocks = BlockManager(1)
    blocks.allocate(1)
    blocks.grow(2)
    assert blocks.num_blocks == 3 and blocks.free_blocks == 2
    assert sorted(blocks.allocate(2)) == [1, 2]
