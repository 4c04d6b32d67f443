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

On CUDA with flash-attention installed, :data:`PACKED_FLASH_ATTENTION` runs the same layout through
flash-attention's varlen kernel instead (``learner.attention_kernel``): every sample's tokens gathered into one
unpadded ``[sum L_i, h, d]`` tensor (``PackedRows.varlen_index``, samples longest first, bounded by
``cu_seqlens``), one causal varlen call, and each row position's output taken back from one copy
(``PackedRows.varlen_target``). :func:`varlen_attention` is that path with the kernel as an argument, so the
index maps are tested on CPU with :func:`reference_varlen_kernel` (SDPA per sample) standing in for the CUDA
kernel.

Both functions are registered with transformers as attention implementations, with SDPA's mask builder;
called without ``packed_source`` they are exactly SDPA, so the model behaves as usual outside the learner's
forward (evaluation, export).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from common.configlib import ConfigError

AttentionKernel = Literal["auto", "sdpa", "flash_varlen"]
PACKED_ATTENTION = "streamrl_packed"
# Not "..._flash": transformers takes any implementation name containing "flash" for its own flash-attention.
PACKED_FLASH_ATTENTION = "streamrl_packed_varlen"
PACKED_IMPLEMENTATIONS = (PACKED_ATTENTION, PACKED_FLASH_ATTENTION)
# A varlen kernel: (q, k, v [N, h(kv), d] concatenated samples, cu_seqlens int32 [b + 1], max_seqlen, scaling)
# -> [N, h, d], causal within each sample.
VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, int, float | None], Tensor]


def _sdpa() -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _refuse_sliding_window(kwargs: dict[str, Any]) -> None:
    if kwargs.get("sliding_window"):
        raise NotImplementedError(
            f"packed rows with sliding-window attention (window {kwargs['sliding_window']}) are not supported"
        )


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
    packed_varlen: tuple[Tensor, Tensor, Tensor, int] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention over packed rows, in the transformers attention-interface signature.

    ``query [r, h, W, d]``, ``key`` / ``value [r, hkv, W, d]`` in row layout. ``packed_source [b, L]``: for
    sample ``i`` and its token ``t``, the flat row position (``row * W + col``) holding that token.
    ``packed_order [b]``: the samples longest first; ``packed_buckets``: ``(start, end, length)`` ranges of
    that order attended together, right-padded to ``length``. ``packed_target [r * W]``: for each flat row
    position, the position in the concatenated, flattened bucket outputs whose result it takes. Returns
    ``[r, W, h, d]`` as SDPA does. Without ``packed_source`` this is SDPA with ``attention_mask``.
    ``packed_varlen`` (the varlen kernels' maps, see :func:`packed_flash_attention`) is not used here.
    """
    sdpa = _sdpa()
    if packed_source is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    if packed_target is None or packed_order is None or packed_buckets is None:
        raise ValueError("packed_source needs packed_target, packed_order and packed_buckets")
    _refuse_sliding_window(kwargs)
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


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    varlen: tuple[Tensor, Tensor, Tensor, int],
    kernel: VarlenKernel,
    scaling: float | None = None,
) -> Tensor:
    """Packed-row attention through a varlen ``kernel``: ``query [r, h, W, d]``, ``key`` / ``value
    [r, hkv, W, d]`` in row layout; ``varlen = (index [N], cu_seqlens int32 [b + 1], target [r * W],
    max_seqlen)`` from :class:`learner.packing.PackedRows`. Returns ``[r, W, h, d]``."""
    index, cu_seqlens, target, max_seqlen = varlen
    rows, heads, width, dim = query.shape

    def gathered(x: Tensor) -> Tensor:  # [r, h, W, d] -> [N, h, d], the samples one after another
        return x.transpose(1, 2).reshape(rows * width, x.shape[1], x.shape[3])[index]

    out = kernel(gathered(query), gathered(key), gathered(value), cu_seqlens, max_seqlen, scaling)
    return out[target].reshape(rows, width, heads, dim)


def reference_varlen_kernel(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scaling: float | None
) -> Tensor:
    """A varlen kernel in plain torch (causal SDPA per sample): what flash-attention's computes, on any
    device; slow (one call per sample), for tests."""
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each kv head serves `groups` query heads
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [h, L, d]
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


def flash_varlen_kernel(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scaling: float | None
) -> Tensor:
    """flash-attention's varlen kernel (CUDA, fp16/bf16; grouped-query attention natively)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scaling, causal=True
    )


def packed_flash_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    packed_source: Tensor | None = None,
    packed_varlen: tuple[Tensor, Tensor, Tensor, int] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """:func:`packed_attention`'s contract through flash-attention's varlen kernel (SDPA without
    ``packed_source``)."""
    if packed_source is None:
        return _sdpa()(module, query, key, value, attention_mask, **kwargs)
    if packed_varlen is None:
        raise ValueError("packed_source needs packed_varlen for the varlen kernel")
    _refuse_sliding_window(kwargs)
    if kwargs.get("dropout", 0.0):
        raise NotImplementedError("the learner's varlen attention runs without attention dropout")
    out = varlen_attention(query, key, value, packed_varlen, flash_varlen_kernel, kwargs.get("scaling"))
    return out, None


def flash_varlen_unavailable(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why flash-attention's varlen kernel cannot serve the learner here, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA only (the learner is on {device.type})"
    if dtype not in (torch.bfloat16, torch.float16):
        return "it needs a bf16 or fp16 compute dtype (learner.mixed_precision = 'bf16')"
    try:
        import flash_attn  # noqa: F401
    except ImportError as exc:
        return f"flash-attn is not installed ({exc})"
    return None


def resolve_attention_kernel(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype | None) -> str:
    """The attention implementation name for ``learner.attention_kernel`` on ``device`` with compute
    ``dtype``: ``auto`` takes flash-attention's varlen kernel where it can serve, else the SDPA buckets."""
    if kernel == "sdpa":
        return PACKED_ATTENTION
    reason = flash_varlen_unavailable(device, dtype)
    if reason is None:
        return PACKED_FLASH_ATTENTION
    if kernel == "flash_varlen":
        raise ConfigError(f"learner.attention_kernel = 'flash_varlen' cannot serve: {reason}")
    return PACKED_ATTENTION


def register_packed_attention(name: str = PACKED_ATTENTION) -> str:
    """Register the implementation ``name`` (idempotent) and return it for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    functions = {PACKED_ATTENTION: packed_attention, PACKED_FLASH_ATTENTION: packed_flash_attention}
    if name not in functions:
        raise ValueError(f"unknown packed attention implementation {name!r}; one of {sorted(functions)}")
    AttentionInterface.register(name, functions[name])
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
