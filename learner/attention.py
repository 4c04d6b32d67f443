"""Packed (varlen) attention: many sequences in one row with no padding, and a group's prompt run once.

The learner's forward runs on packed rows (``learner.packing.PackedRows``). A row concatenates segments; a
segment is either one sequence (prompt + output) or a shared-prompt segment ``[prompt, output_1, ...,
output_k]`` that holds a GRPO group's prompt once for all its samples. Position ids restart at 0 at each
segment, and each output of a shared segment restarts at ``len(prompt)``, so every token sits at the position
it has in its own sample. The token-wise layers (projections, MLPs: nearly all the FLOPs) therefore see no
padding and each shared prompt token once.

Attention is the only layer that mixes positions. A sample's token must see the earlier tokens of its own
sample (its prompt and its own output) and nothing else: no other sequence of the row, no sibling output. Both
cases are one mask shape, "causal within the sample", and one code path serves them:
:func:`packed_attention` gathers each sample's queries, keys and values out of the packed row by an index
(``packed_source``: sample ``i``'s token ``t`` lives at flat row position ``source[i, t]``; a plain sequence's
index is a contiguous range, a shared sample's index is its prompt's range followed by its output's), runs
causal SDPA per bucket of samples of similar lengths (right-padded within the bucket only, so the padding
never reaches a real token), and scatters each row position's output back from one of its copies
(``packed_target``). Its cost is that of causal attention over each sample alone (sum of L_i^2, what a varlen
kernel costs), never of the whole row squared, and no ``[T, T]`` mask is ever built: the learner passes no
attention mask. Gradients are exact: a shared prompt token's key and value collect the gradient of every
sample that attends to them (the gather's backward sums), and its query and output are used from one copy.

The function is registered with transformers as attention implementation :data:`PACKED_ATTENTION`, with
SDPA's mask builder; called without ``packed_source`` it is exactly SDPA, so the model behaves as usual
outside the learner's forward (evaluation, export).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

PACKED_ATTENTION = "streamrl_packed"
# Older name of the same implementation (it first served shared prompt rows only).
SHARED_PROMPT_ATTENTION = PACKED_ATTENTION


def _sdpa() -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    packed_source: Tensor | None = None,
    packed_target: Tensor | None = None,
    packed_order: Tensor | None = None,
    packed_buckets: list[tuple[int, int, int]] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention over packed rows, in the transformers attention-interface signature.

    ``query [r, h, W, d]``, ``key`` / ``value [r, hkv, W, d]`` in row layout. ``packed_source [b, L]``: for
    sample ``i`` and its token ``t``, the flat row position (``row * W + col``) holding that token.
    ``packed_order [b]``: the samples longest first; ``packed_buckets``: ``(start, end, length)`` ranges of
    that order attended together, right-padded to ``length``. ``packed_target [r * W]``: for each flat row
    position, the position in the concatenated, flattened bucket outputs whose result it takes. Returns
    ``[r, W, h, d]`` as SDPA does. Without ``packed_source`` this is SDPA with ``attention_mask``.
    """
    sdpa = _sdpa()
    if packed_source is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    if packed_target is None or packed_order is None or packed_buckets is None:
        raise ValueError("packed_source needs packed_target, packed_order and packed_buckets")
    if kwargs.get("sliding_window"):
        raise NotImplementedError(
            f"packed rows with sliding-window attention (window {kwargs['sliding_window']}) are not supported"
        )
    rows, heads, width, dim = query.shape

    def flat(x: Tensor) -> Tensor:  # [r, h, W, d] -> [r * W, h, d]
        return x.transpose(1, 2).reshape(rows * width, x.shape[1], x.shape[3])

    q, k, v = flat(query), flat(key), flat(value)
    outputs = []
    for start, end, length in packed_buckets:
        index = packed_source[packed_order[start:end], :length]
        # Right-padded per-sample rows: causal attention alone keeps every real token off the padding.
        out, _ = sdpa(
            module,
            q[index].transpose(1, 2),
            k[index].transpose(1, 2),
            v[index].transpose(1, 2),
            None,
            **kwargs,
        )
        outputs.append(out.reshape(-1, heads, dim))
    return torch.cat(outputs)[packed_target].reshape(rows, width, heads, dim), None


def register_packed_attention() -> str:
    """Register the implementation (idempotent) and return its name for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    return PACKED_ATTENTION


# Older name, kept for callers that load the learner's model with it.
register_shared_prompt_attention = register_packed_attention
