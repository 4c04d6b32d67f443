"""Decode attention over a paged KV cache, two ways that compute the same thing.

``gathered``: copy each sequence's blocks into one contiguous ``[B, kv_heads, W * block_size, head_dim]`` tensor
(:meth:`PagedKVCache.gather`) and attend as over a contiguous cache. Simple, but the copy reads the KV in
block-sized random pieces and writes it again before the attention reads it: at long contexts the step costs
about three times the contiguous cache's attention, and a ragged batch pays for its longest sequence.

``block range``: attend *block by block in pool order* over the range of blocks the batch uses, read in place
(a view of the pool, no copy). Each block gets the queries of the sequences whose tables hold it (``S`` query
slots per block: more than one where a group shares prompt blocks), one batched matrix product scores them
all, the scores are regrouped per sequence (small tensors: one number per key) for the softmax, and a second
batched product with the values gives each slot's share of its sequence's output, which ``index_add`` sums.
The KV is read once, as a contiguous cache reads it; blocks in the range that no sequence uses are computed
and ignored, so it pays only when the range is dense (:func:`plan_block_range` decides; the allocator hands out
the lowest free block, which keeps it so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Measured on CPU (2026-12-02, tiny model, 1 thread): per block, the block-range attention costs about what a
# contiguous cache costs, gathering two to three times that. So a range of up to twice the gathered volume
# (B x W blocks, padding included) is still the cheaper way.
MAX_RANGE_VS_GATHERED = 2.0
MAX_SHARERS = 16  # query slots per block beyond which the block-range products grow too wide


@dataclass(frozen=True)
class BlockRangePlan:
    """Index tensors for one decode step's block-range attention (built once, used by every layer).

    ``R = hi - lo`` pool blocks, ``S`` slots each; a *pair* is (sequence b, table column m), index ``b * W + m``.
    """

    lo: int
    hi: int
    sharers: int  # S
    width: int  # W, table columns
    slot_seq: torch.Tensor  # [R * S] the sequence of each slot; B (a zero query row) for empty slots
    slot_pair: torch.Tensor  # [R * S] the pair of each slot; B * W (a zero probability row) for empty slots
    pair_slot: torch.Tensor  # [B * W] the slot of each pair; 0 for padding columns (their keys are masked)


def plan_block_range(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> BlockRangePlan | None:
    """The plan for block tables ``table`` [B, W] whose sequences attend to keys ``0..positions`` [B]; None when
    the batch should gather instead (a sparse block range, or too many sharers of a block)."""
    b, w = table.shape
    device = table.device
    used = torch.arange(w, device=device).unsqueeze(0) <= (positions // block_size).unsqueeze(1)
    pairs = used.flatten().nonzero().squeeze(1)  # [P]
    blocks = table.flatten()[pairs]
    lo, hi = int(blocks.min()), int(blocks.max()) + 1
    if hi - lo > MAX_RANGE_VS_GATHERED * b * w:
        return None
    rel = blocks - lo
    counts = torch.bincount(rel, minlength=hi - lo)
    sharers = int(counts.max())
    if sharers > MAX_SHARERS:
        return None
    # The rank of each pair among the pairs of its block: its slot in that block.
    order = torch.argsort(rel, stable=True)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(pairs.numel(), device=device) - first[rel[order]]
    slot = rel * sharers + rank
    size = (hi - lo) * sharers
    slot_seq = torch.full((size,), b, dtype=torch.long, device=device)
    slot_seq[slot] = pairs // w
    slot_pair = torch.full((size,), b * w, dtype=torch.long, device=device)
    slot_pair[slot] = pairs
    pair_slot = torch.zeros(b * w, dtype=torch.long, device=device)
    pair_slot[pairs] = slot
    return BlockRangePlan(lo, hi, sharers, w, slot_seq, slot_pair, pair_slot)


def attend_gathered(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [B, kv_heads, G, D] (G query heads per KV head), keys / values [B, kv_heads, L, D], bias [B, 1, 1, L]
    (0 or -inf) -> [B, kv_heads, G, D]."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling + bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values)


def _slots_major(x: torch.Tensor, r: int, s: int, kv: int, inner: tuple[int, ...]) -> torch.Tensor:
    """[R * S, kv, *inner] (slot-major) -> [R, kv, S * inner[0], *inner[1:]] for the batched products."""
    if s == 1:
        return x.view(r, kv, *inner)
    return x.view(r, s, kv, *inner).transpose(1, 2).reshape(r, kv, s * inner[0], *inner[1:])


def _slots_minor(x: torch.Tensor, r: int, s: int, kv: int, inner: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`_slots_major`, flattened: [R, kv, S * inner[0], ...] -> [R * S, kv * prod(inner)]."""
    if s == 1:
        return x.reshape(r, -1)
    return x.reshape(r, kv, s, *inner).transpose(1, 2).reshape(r * s, -1)


def attend_block_range(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: BlockRangePlan,
    bias: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """:func:`attend_gathered` with the keys and values read in place from one layer's pool tensors
    ``[num_blocks, kv_heads, block_size, D]`` over ``plan``'s block range. Same shapes in and out."""
    b, kv, g, d = q.shape
    r, s, w = plan.hi - plan.lo, plan.sharers, plan.width
    bs = k_pool.shape[2]
    keys, values = k_pool[plan.lo : plan.hi], v_pool[plan.lo : plan.hi]  # views: [R, kv, bs, D]
    zero_q = q.new_zeros(1, kv * g * d)
    slot_q = torch.cat([q.reshape(b, -1), zero_q]).index_select(0, plan.slot_seq)  # [R * S, kv * G * D]
    scores = torch.matmul(_slots_major(slot_q, r, s, kv, (g, d)), keys.transpose(-1, -2))  # [R, kv, S*G, bs]
    per_pair = _slots_minor(scores, r, s, kv, (g, bs)).index_select(0, plan.pair_slot)  # [B * W, kv * G * bs]
    per_seq = per_pair.view(b, w, kv, g, bs).permute(0, 2, 3, 1, 4).reshape(b, kv, g, w * bs)
    probs = torch.softmax(per_seq.float() * scaling + bias, dim=-1).to(q.dtype)
    probs = probs.view(b, kv, g, w, bs).permute(0, 3, 1, 2, 4).reshape(b * w, -1)
    zero_p = probs.new_zeros(1, probs.shape[1])
    slot_p = torch.cat([probs, zero_p]).index_select(0, plan.slot_pair)  # [R * S, kv * G * bs]
    partial = torch.matmul(_slots_major(slot_p, r, s, kv, (g, bs)), values)  # [R, kv, S * G, D]
    # Summed over a sequence's blocks in float32: bf16 would lose precision over thousands of blocks.
    out = torch.zeros(b + 1, kv * g * d, dtype=torch.float32, device=q.device)
    out.index_add_(0, plan.slot_seq, _slots_minor(partial, r, s, kv, (g, d)).float())
    return out[:b].view(b, kv, g, d).to(q.dtype)
