"""The prefix-block bookkeeping: longest resident prefix, pins, least-recently-used eviction."""

from __future__ import annotations

import pytest

from kvrs.errors import InvalidArgument
from kvrs.prefix_blocks import PrefixBlocks
from kvrs.tokenizer import prefix_block_hashes


def test_a_prompt_hits_only_the_resident_blocks_at_its_start():
    blocks = PrefixBlocks()
    shared = list(range(100))
    first = prefix_block_hashes([*shared, 1, 2, 3, 4], 25)
    for block_hash in first:
        blocks.insert(block_hash)
    second = prefix_block_hashes([*shared, 9, 9, 9, 9], 25)
    assert blocks.resident_prefix(second) == 4  # the 100 shared tokens, not the tail
    other = prefix_block_hashes([7, *shared[1:]], 25)
    assert blocks.resident_prefix(other) == 0  # chained: a different first block misses all
    assert not blocks.insert(first[0]) and len(blocks) == 4


def test_eviction_takes_the_least_recently_used_and_never_a_pinned_block():
    blocks = PrefixBlocks()
    for block_hash in (1, 2, 3, 4):
        blocks.insert(block_hash)
    blocks.acquire([1])
    blocks.acquire([2])
    blocks.release([2])  # 2 is now the most recently used idle block
    assert blocks.evictable == 3
    assert blocks.evict(2) == [3, 4]
    assert blocks.evict(5) == [2]  # 1 is pinned
    assert 1 in blocks and len(blocks) == 1
    blocks.release([1])
    assert blocks.evict(1) == [1] and len(blocks) == 0


def test_pins_must_match():
    blocks = PrefixBlocks()
    blocks.insert(5)
    with pytest.raises(InvalidArgument):
        blocks.acquire([5, 6])
    with pytest.raises(InvalidArgument):
        blocks.release([5])
    blocks.acquire([5])
    blocks.acquire([5])
    blocks.release([5])
    assert blocks.evict(1) == []
    assert blocks.hashes() == [5]
