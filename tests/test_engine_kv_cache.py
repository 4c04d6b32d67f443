"""The paged KV cache's bookkeeping: reference counts, the free list, the prefix cache (exact keys, LRU eviction
of leaves first, clearing on weight updates) and the gather layout the runner's attention reads."""

from __future__ import annotations

import pytest
import torch

from rollout_fleet.engine.kv_cache import NULL_BLOCK, BlockAllocator, PagedKVCache

BS = 4


def test_allocation_is_bounded_and_never_hands_out_the_null_block() -> None:
    alloc = BlockAllocator(num_blocks=5, block_size=BS)
    assert alloc.capacity_blocks == 4 and alloc.capacity_tokens == 16
    blocks = alloc.allocate(4)
    assert blocks is not None and sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK not in blocks
    assert alloc.allocate(1) is None and alloc.available() == 0 and alloc.used() == 4
    alloc.release(blocks[:2])
    assert alloc.available() == 2 and alloc.peak_used == 4
    again = alloc.allocate(2)
    assert again is not None and sorted(again) == sorted(blocks[:2])  # freed blocks are reused
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockAllocator(num_blocks=1, block_size=BS)


def test_shared_blocks_are_freed_by_the_last_reference() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=BS)
    blocks = alloc.allocate(2)
    alloc.share(blocks)
    alloc.release(blocks)
    assert alloc.available() == 1  # still referenced by the sharer
    alloc.release(blocks)
    assert alloc.available() == 3
    with pytest.raises(RuntimeError, match="released more often"):
        alloc.release(blocks[:1])


def test_prefix_match_is_exact_and_by_whole_blocks() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=BS)
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks and a partial one
    table = alloc.allocate(3)
    alloc.register(table, tokens, full=2)
    assert alloc.cached() == 2
    assert alloc.match(tokens, limit=len(tokens)) == table[:2]
    assert alloc.match(tokens, limit=7) == table[:1]  # the limit cuts to whole blocks
    assert alloc.match([10, 11, 12, 13, 14, 15, 16, 99], limit=8) == table[:1]  # second block differs
    assert alloc.match([99, *tokens[1:]], limit=11) == []  # a block is found only under its parent
    # the same tokens in a second block chain do not displace the first one
    other = alloc.allocate(2)
    alloc.register(other, tokens, full=2)
    assert alloc.match(tokens, limit=11) == table[:2] and alloc.cached() == 2


def test_unreferenced_cached_blocks_are_evicted_lru_leaves_first() -> None:
    alloc = BlockAllocator(num_blocks=7, block_size=BS)  # 6 usable blocks
    a, b = list(range(8)), list(range(100, 108))
    ta, tb = alloc.allocate(2), alloc.allocate(2)
    alloc.register(ta, a, full=2)
    alloc.register(tb, b, full=2)
    alloc.release(ta)  # a first: least recently released; within a table, the last block first
    alloc.release(tb)
    assert alloc.available() == 6 and alloc.used() == 0 and alloc.cached() == 4
    hit = alloc.match(b, limit=8)
    assert hit == tb and alloc.evictable_among(hit) == 2
    alloc.share(hit)  # b is referenced again: not evictable
    fresh = alloc.allocate(3)  # 2 free + 1 eviction: a's leaf, its first block stays findable
    assert fresh is not None and alloc.evictions == 1
    assert alloc.match(a, limit=8) == ta[:1] and alloc.match(b, limit=8) == tb
    assert alloc.allocate(2) is None  # what is left: a's first block
    assert alloc.allocate(1) is not None and alloc.match(a, limit=8) == []


def test_evicting_a_block_evicts_its_cached_descendants() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=BS)
    tokens = list(range(8))
    table = alloc.allocate(2)
    alloc.register(table, tokens, full=2)
    alloc.release(table[:1])  # the parent becomes the least recently released
    alloc.release(table[1:])
    assert alloc.allocate(2) is not None  # one free block + evicting the parent, which takes its child
    assert alloc.evictions == 2 and alloc.cached() == 0 and alloc.available() == 1
    assert alloc.match(tokens, limit=8) == []


def test_clear_cache_forgets_every_key_and_starts_a_new_epoch() -> None:
    alloc = BlockAllocator(num_blocks=6, block_size=BS)
    tokens = list(range(8))
    held, dropped = alloc.allocate(2), alloc.allocate(2)
    alloc.register(held, tokens, full=2)
    alloc.register(dropped, list(range(50, 58)), full=2)
    alloc.release(dropped)
    epoch = alloc.epoch
    alloc.clear_cache()
    assert alloc.epoch == epoch + 1 and alloc.cached() == 0
    assert alloc.match(tokens, limit=8) == []
    assert alloc.available() == 3  # the unreferenced cached blocks are free now
    alloc.release(held)  # blocks that lost their key go back to the free list, not to the cache
    assert alloc.available() == 5 and alloc.cached() == 0


def test_gather_lays_out_each_sequences_blocks_in_table_order() -> None:
    cache = PagedKVCache(
        1, 2, 3, num_blocks=6, block_size=BS, dtype=torch.float32, device=torch.device("cpu")
    )
    blocks = cache.allocate(5)
    assert all(cache.k[0][b].abs().sum() == 0 for b in [NULL_BLOCK, *blocks])  # zeroed when handed out
    for b in blocks:
        cache.k[0][b] = b
        cache.v[0][b] = -b
    tables = [[blocks[3], blocks[0]], [blocks[4]]]
    index = cache.gather_index(cache.table_tensor(tables, width=2))
    keys, values = cache.gather(0, index, 2)
    assert keys.shape == (2, 2, 2 * BS, 3) and keys.is_contiguous()
    assert keys[0, :, :BS].eq(blocks[3]).all() and keys[0, :, BS:].eq(blocks[0]).all()
    assert keys[1, :, :BS].eq(blocks[4]).all() and keys[1, :, BS:].eq(0).all()  # padding: the null block
    assert values[0, 1, BS:].eq(-blocks[0]).all()
    cache.copy_block(blocks[3], blocks[1], length=2)
    assert (
        cache.k[0][blocks[1], :, :2].eq(blocks[3]).all() and cache.k[0][blocks[1], :, 2:].eq(blocks[1]).all()
    )
