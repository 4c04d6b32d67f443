"""The engine's paged KV cache: fixed-size blocks in one pool, a block table per request, a prefix cache.

Memory is a pool of ``num_blocks`` blocks of ``block_size`` token positions, per layer a key and a value tensor
``[num_blocks, kv_heads, block_size, head_dim]``. A request owns a *block table* (a list of block ids, in order),
so its KV needs only as many blocks as it has tokens, wherever they lie in the pool. Blocks are reference
counted: the samples of one prompt share its full blocks; only a request's last, partial block is ever written,
and that one is private (a sharer gets a copy), so a shared block is read-only.

The prefix cache maps token ids to full blocks. A block's key is ``(parent block, its block_size token ids)``:
a radix tree with one node per block, exact (no hashing, so no collisions), in which a prompt's blocks are found
by walking from the root. A cached block nobody references stays in the pool as *evictable*, least recently
released first, and is reclaimed (with any cached descendants) when the pool needs space. ``clear_cache``
forgets every key: the engine calls it when the weights change, since KV computed under old weights must never
be reused. Each clear starts a new ``epoch``; callers register blocks only when their KV is of the current one.

Block 0 is the null block: never handed out, zero, and what padded block-table entries point at.
"""

from __future__ import annotations

import array
import collections
import heapq
import math
import mmap
from collections.abc import Sequence

import torch

NULL_BLOCK = 0
Key = tuple[int, tuple[int, ...]]  # (parent block or -1 for the first block, the block's token ids)


class BlockAllocator:
    """Block ids, reference counts, the free list and the prefix cache; no tensors (pure bookkeeping)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        # A min-heap: the lowest free id is handed out first, so the blocks in use stay packed at the bottom of
        # the pool (few pages touched, and a dense range for the block-range attention).
        self._free: list[int] = list(range(NULL_BLOCK + 1, num_blocks))
        self._key: dict[int, Key] = {}  # cached block -> its key
        self._by_key: dict[Key, int] = {}
        self._children: dict[int, set[int]] = {}  # cached block -> cached blocks whose key names it
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.epoch = 0  # bumped by clear_cache: KV of an older epoch is never registered
        self.peak_used = 0  # most blocks referenced at once
        self.evictions = 0

    # -- capacity ---------------------------------------------------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    def available(self) -> int:
        """Blocks an ``allocate`` can hand out now: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    def used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.capacity_blocks - self.available()

    def cached(self) -> int:
        """Blocks in the prefix cache (referenced or not)."""
        return len(self._key)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    # -- references -------------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with reference count 1, evicting cached blocks as needed; None if there is no room."""
        if n > self.available():
            return None
        while len(self._free) < n:
            self._evict_one()
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        self._note_peak()
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each of ``blocks`` (a cached one stops being evictable)."""
        for b in blocks:
            if self.refcount[b] == 0:
                self._evictable.pop(b, None)
            self.refcount[b] += 1
        self._note_peak()

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. Unreferenced cached blocks become evictable, last block first, so
        the leaves of a chain are evicted before the blocks they extend."""
        for b in reversed(blocks):
            self.refcount[b] -= 1
            if self.refcount[b] > 0:
                continue
            if self.refcount[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than referenced")
            if b in self._key:
                self._evictable[b] = None
            else:
                heapq.heappush(self._free, b)

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.used())

    # -- the prefix cache -------------------------------------------------------------------------------------

    def _block_key(self, parent: int, tokens: Sequence[int], i: int) -> Key:
        bs = self.block_size
        return (parent, tuple(tokens[i * bs : (i + 1) * bs]))

    def match(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The cached blocks holding the longest prefix of ``tokens`` of at most ``limit`` tokens (whole blocks
        only). Takes no reference: call ``share`` on the result to use it."""
        blocks: list[int] = []
        parent = -1
        for i in range(min(limit, len(tokens)) // self.block_size):
            b = self._by_key.get(self._block_key(parent, tokens, i))
            if b is None:
                break
            blocks.append(b)
            parent = b
        return blocks

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` nobody references (sharing them takes them out of ``available``)."""
        return sum(1 for b in blocks if self.refcount[b] == 0)

    def register(self, blocks: Sequence[int], tokens: Sequence[int], full: int) -> None:
        """Enter the first ``full`` blocks of a table (all written, holding ``tokens``) into the prefix cache.

        Stops at the first block whose key another block already holds: the chain continues from that block,
        not from this table's copy, so this table's later blocks cannot be found by a walk from the root."""
        parent = -1
        for i in range(full):
            b = blocks[i]
            key = self._block_key(parent, tokens, i)
            holder = self._by_key.get(key)
            if holder is None and b not in self._key:
                self._key[b], self._by_key[key] = key, b
                if parent >= 0:
                    self._children.setdefault(parent, set()).add(b)
            elif holder != b:
                return
            parent = b

    def clear_cache(self) -> None:
        """Forget every key (after a weight update, or a flush); referenced blocks stay with their owners."""
        for b in list(self._evictable):
            heapq.heappush(self._free, b)
        self._evictable.clear()
        self._key.clear()
        self._by_key.clear()
        self._children.clear()
        self.epoch += 1

    def _evict_one(self) -> None:
        """Free the least recently released cached block and its cached descendants (which nothing references:
        a table holding a block holds its parent, so an unreferenced block has unreferenced descendants)."""
        stack = [next(iter(self._evictable))]
        while stack:
            b = stack.pop()
            key = self._key.pop(b)
            del self._by_key[key]
            if key[0] >= 0:
                self._children.get(key[0], set()).discard(b)
            stack.extend(self._children.pop(b, ()))
            if b in self._evictable:  # a descendant still referenced only loses its key
                del self._evictable[b]
                heapq.heappush(self._free, b)
            self.evictions += 1

    def reset(self) -> None:
        """Free everything (after a failed step, when no request holds blocks any more)."""
        self.clear_cache()
        self.refcount = [0] * self.num_blocks
        self._free = list(range(NULL_BLOCK + 1, self.num_blocks))


class PagedKVCache:
    """The pool tensors of every layer, ``[num_blocks, kv_heads, block_size, head_dim]``, and their allocator.

    The tensors are allocated uninitialised; a block is zeroed the first time it is handed out, so on CPU the
    pages of never-used blocks are never touched (the OS commits memory as the KV grows) and no read of a
    masked-out slot can meet a non-finite value (``0 * NaN`` would poison an attention row).

    Sleep and wake (SGLang's ``release_memory_occupation`` tag ``kv_cache``): :meth:`release` frees the pool and
    :meth:`resume` allocates it again, empty. On CPU the pool is one anonymous ``mmap`` of its own, not a heap
    allocation, so that a release really returns its pages to the OS (glibc keeps freed heap memory below its
    dynamic mmap threshold, up to 32 MiB a block, for reuse; the resident size would not fall)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size = block_size
        self.dtype, self.device = dtype, device
        self.shape = (num_blocks, kv_heads, block_size, head_dim)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._gathered: list[torch.Tensor] = []
        self._zeroed = 0  # blocks [0, _zeroed) have been written at least once
        self.resume()

    @property
    def released(self) -> bool:
        return not self.k

    @property
    def pool_bytes(self) -> int:
        """The pool's size: keys and values of every layer (what a release frees)."""
        return 2 * self.num_layers * math.prod(self.shape) * self.dtype.itemsize

    def _allocate(self) -> list[torch.Tensor]:
        count = 2 * self.num_layers
        if self.device.type != "cpu":
            return [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in range(count)]
        region = mmap.mmap(-1, self.pool_bytes)  # anonymous, private: pages committed on first write
        pool = torch.frombuffer(region, dtype=self.dtype).view(count, *self.shape)
        return list(pool.unbind(0))  # the region is unmapped when the last of these views dies

    def release(self) -> None:
        """Free the pool (no request may hold blocks): every block is free again and the prefix cache empty."""
        self.allocator.reset()
        self.k, self.v, self._gathered = [], [], []
        self._zeroed = 0

    def resume(self) -> None:
        """Allocate the pool again (a no-op while it is allocated); its contents start undefined, as at start."""
        if not self.released:
            return
        tensors = self._allocate()
        self.k, self.v = tensors[0::2], tensors[1::2]
        # Gathered keys / values of one layer, reused by the next: a fresh multi-megabyte tensor per layer and
        # step costs page faults that take longer than the copy itself.
        self._gathered = [torch.empty(0, dtype=self.dtype, device=self.device) for _ in range(2)]
        self._zero_upto(NULL_BLOCK + 1)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def _zero_upto(self, end: int) -> None:
        if end <= self._zeroed:
            return
        for t in (*self.k, *self.v):
            t[self._zeroed : end].zero_()
        self._zeroed = end

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (see :meth:`BlockAllocator.allocate`), each finite in every slot."""
        blocks = self.allocator.allocate(n)
        if blocks:
            self._zero_upto(max(blocks) + 1)
        return blocks

    def copy_block(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of block ``src`` into block ``dst`` (a sharer's partial block)."""
        for t in (*self.k, *self.v):
            t[dst, :, :length].copy_(t[src, :, :length])

    def table_tensor(self, tables: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        """Block tables as one ``[N, width]`` tensor, padded with the null block (built through a flat int64
        array: the per-step cost of nested lists shows at a hundred sequences)."""
        flat = array.array("q")
        for t in tables:
            flat.extend(t[:width])
            if len(t) < width:
                flat.extend([NULL_BLOCK] * (width - len(t)))
        table = torch.frombuffer(flat, dtype=torch.long).view(len(tables), width)
        return table.to(self.device, copy=True)

    def gather_index(self, table: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's pool viewed as ``[num_blocks * kv_heads, block_size * head_dim]`` that, taken in
        order, give each sequence's keys as ``[N, kv_heads, width * block_size, head_dim]`` contiguous: the index
        runs over (sequence, head, block). One index serves every layer, keys and values."""
        heads = torch.arange(self.kv_heads, device=self.device).view(1, -1, 1)
        return (table.unsqueeze(1) * self.kv_heads + heads).reshape(-1)

    def gather(self, li: int, index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``li``'s keys and values for ``n`` sequences, ``[n, kv_heads, width * block_size, head_dim]``.

        The results are views of buffers the next ``gather`` overwrites: use them before gathering again."""
        row = self.block_size * self.head_dim
        flat = (self.num_blocks * self.kv_heads, row)
        shape = (n, self.kv_heads, -1, self.head_dim)
        out = []
        for i, pool in enumerate((self.k[li], self.v[li])):
            if self._gathered[i].numel() < index.numel() * row:
                self._gathered[i] = torch.empty(index.numel() * row, dtype=self.dtype, device=self.device)
            buf = self._gathered[i][: index.numel() * row].view(-1, row)
            out.append(torch.index_select(pool.view(flat), 0, index, out=buf).view(shape))
        return out[0], out[1]

    def write(
        self, li: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store ``k``, ``v`` ``[M, kv_heads, head_dim]`` of M tokens at (block, offset) pairs ``[M]``."""
        self.k[li][blocks, :, offsets] = k
        self.v[li][blocks, :, offsets] = v

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.k[0].element_size()

    def reset(self) -> None:
        """Free every block and forget the prefix cache (after a failed step)."""
        self.allocator.reset()
