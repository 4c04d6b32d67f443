"""Shared-prompt attention: run a group's prompt through the model once, not once per sample.

A GRPO step trains every prompt ``group_size`` times, once per sample. In a plain padded batch each sample's
row repeats the prompt, so the projections and MLPs (almost all of the FLOPs) see the prompt ``group_size``
times. A shared row instead holds ``[prompt, output_1, ..., output_k]`` with position ids that restart at
``len(prompt)`` for every output (``learner.packing`` builds it), so the token-wise layers run each prompt
token once.

Attention is the only layer that mixes positions, and in a shared row output ``j`` must see the prompt and
its own earlier tokens, never another output. Rather than an ``[W, W]`` tree mask over the whole row (its
cost grows with the square of the row, ``k`` outputs wide), :func:`shared_prompt_attention` gathers the
row's queries, keys and values into the ordinary per-sample layout (``[b, L]``: each sample's prompt and
output, right-padded), runs causal SDPA there, and scatters each row position's output back from one of its
copies. The attention itself costs what it costs unshared; the projections and MLPs run on the shared rows.
Gradients are exact: a prompt token's key and value collect the gradient of every sample that attends to
them (the gather's backward sums), and its query and output are used from one copy only.

The function is registered with transformers as attention implementation :data:`SHARED_PROMPT_ATTENTION`,
with SDPA's mask builder; called without the ``prompt_source`` keyword it is exactly SDPA, so the model
behaves as usual outside the learner's shared forward (evaluation, export, ordinary micro-batches).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

SHARED_PROMPT_ATTENTION = "streamrl_shared_prompt"


def _sdpa() -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def shared_prompt_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    prompt_source: Tensor | None = None,
    prompt_target: Tensor | None = None,
    prompt_buckets: list[tuple[int, int, int]] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention over shared rows, in the transformers attention-interface signature.

    ``query [r, h, W, d]``, ``key`` / ``value [r, hkv, W, d]`` in row layout. ``prompt_source [b, L]``: for
    sample ``i`` and its token ``t``, the flat row position (``row * W + col``) holding that token.
    ``prompt_buckets``: ``(start, end, length)`` ranges of samples attended together, right-padded to
    ``length`` (samples of similar lengths, so little padding). ``prompt_target [r * W]``: for each flat row
    position, the position in the concatenated, flattened bucket outputs whose result it takes. Returns
    ``[r, W, h, d]`` as SDPA does. Without ``prompt_source`` this is SDPA with ``attention_mask``.
    """
    sdpa = _sdpa()
    if prompt_source is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    if prompt_target is None or prompt_buckets is None:
        raise ValueError("prompt_source needs prompt_target and prompt_buckets")
    if kwargs.get("sliding_window"):
        raise NotImplementedError(
            f"shared prompt rows with sliding-window attention (window {kwargs['sliding_window']}): "
            "set learner.share_prompts=false for this model"
        )
    rows, heads, width, dim = query.shape

    def flat(x: Tensor) -> Tensor:  # [r, h, W, d] -> [r * W, h, d]
        return x.transpose(1, 2).reshape(rows * width, x.shape[1], x.shape[3])

    q, k, v = flat(query), flat(key), flat(value)
    outputs = []
    for start, end, length in prompt_buckets:
        index = prompt_source[start:end, :length]
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
    return torch.cat(outputs)[prompt_target].reshape(rows, width, heads, dim), None


def register_shared_prompt_attention() -> str:
    """Register the implementation (idempotent) and return its name for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_PROMPT_ATTENTION, shared_prompt_attention)
    AttentionMaskInterface.register(SHARED_PROMPT_ATTENTION, sdpa_mask)
    return SHARED_PROMPT_ATTENTION
