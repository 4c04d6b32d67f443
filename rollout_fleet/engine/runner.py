"""Batched prefill and decode of a Hugging Face decoder-only model over a paged KV cache.

Why not HF's cache classes: continuous batching needs sequences that join and leave a running batch between
steps, each with its own length, and memory that is shared between sequences and bounded. HF's caches assume
one padded batch that lives and dies together. This module runs the HF model's own modules (norms, output and
down projections, rotary tables) in its own attention loop, so the weights stay the HF model's parameters
(``load_weights`` is a copy by HF name) and a teacher-forced forward of the same HF model gives the same
log-probs. The q/k/v and gate/up projections run as one matrix each (:func:`fuse_layer`); their HF parameters
become views of those matrices, so a copy by name updates them.

The KV lives in :class:`~rollout_fleet.engine.kv_cache.PagedKVCache` blocks; callers (the scheduler) own the
block tables and pass them in. A forward pass first writes each new token's K/V into its sequence's blocks.
Prefill then gathers each sequence's blocks into one contiguous ``[N, kv_heads, length, head_dim]`` tensor per
layer and attends with a causal length mask; it computes any range ``[start, end)`` of a sequence whose first
``start`` tokens are already in its blocks (a prefix-cache hit, or the earlier chunks of a chunked prefill).
Decode attends block by block over the pool in place, or gathers when the batch's blocks are spread too thin
(:mod:`rollout_fleet.engine.attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rollout_fleet.engine.attention import attend_block_range, attend_gathered, plan_block_range
from rollout_fleet.engine.kv_cache import PagedKVCache

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the built-in engine's forward implements."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class FusedLayer:
    """One layer's projections as single matrices: q, k and v stacked ``[(heads + 2 kv_heads) * D, hidden]``
    and, when the MLP has no biases, gate and up stacked ``[2 * intermediate, hidden]``. The HF parameters are
    row views of these, so a weight update (a copy into the parameters by HF name) updates them too."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor | None


def _stack_as_views(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """Concatenate ``params`` along dim 0 and make each parameter a view of its rows of the result."""
    with torch.no_grad():
        stacked = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = stacked[start : start + p.shape[0]]
            start += p.shape[0]
    return stacked


def fuse_layer(layer: nn.Module) -> FusedLayer:
    """Stack a decoder layer's q/k/v (and gate/up) projections; a decode step then runs 2 matrix products where
    it ran 5, which on small models is most of the per-step overhead."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    biases = [proj.bias for proj in projections]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise UnsupportedModelError("q, k and v projections must all have biases or none")
    qkv_bias = None if biases[0] is None else _stack_as_views(biases)
    qkv_weight = _stack_as_views([proj.weight for proj in projections])
    gate_up = None
    if mlp.gate_proj.bias is None and mlp.up_proj.bias is None:
        gate_up = _stack_as_views([mlp.gate_proj.weight, mlp.up_proj.weight])
    return FusedLayer(qkv_weight, qkv_bias, gate_up)


def check_architecture(model: nn.Module) -> None:
    """Refuse models whose forward differs from the Llama / Qwen2 / Qwen3 decoder this runner implements."""
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model architecture {arch!r} is not supported by the built-in engine; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"{arch} with layer types {sorted(set(layer_types))}: only full attention is supported "
            "(sliding-window layers are not)"
        )


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's share of a prefill pass: compute ``tokens[start:end]``, attending to the KV of
    ``tokens[:start]`` already in ``blocks`` (which cover at least ``end`` positions), and return the logits at
    ``logit_positions`` (absolute positions in ``[start, end)``)."""

    blocks: Sequence[int]
    tokens: Sequence[int]
    start: int
    end: int
    logit_positions: Sequence[int]


class ModelRunner:
    """Prefill and decode over the HF model's modules with a :class:`PagedKVCache` (inference only)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_context_len: int,
        max_total_tokens: int,
        block_size: int = 16,
        fuse_projections: bool = True,
    ) -> None:
        check_architecture(model)
        if block_size < 1:
            raise ValueError(f"engine.kv_block_size must be at least 1, got {block_size}")
        if max_total_tokens < block_size:
            raise ValueError(
                f"engine.max_total_tokens = {max_total_tokens} is smaller than one KV block "
                f"(engine.kv_block_size = {block_size})"
            )
        self.model = model
        config = model.config
        first = model.model.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.groups = self.num_heads // self.kv_heads
        self.scaling = float(getattr(first, "scaling", self.head_dim**-0.5))
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_context_len = max_context_len
        self.block_size = block_size
        self.cache = PagedKVCache(
            len(model.model.layers),
            self.kv_heads,
            self.head_dim,
            num_blocks=max_total_tokens // block_size + 1,  # + the null block
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )
        self._build_rope_table()
        # None: the HF modules' own projections, one matrix product each (the baseline of
        # benchmarks/engine_decode.py)
        self.fused = [fuse_layer(layer) for layer in model.model.layers] if fuse_projections else None
        self.prefill_tokens_computed = 0  # tokens run through the model by prefill
        # "auto": read the KV in place where the batch's block range is dense (attention.py), else gather;
        # "gathered" / "block_range" force one way (tests, benchmarks)
        self.decode_attention: str = "auto"

    @torch.inference_mode()
    def _build_rope_table(self) -> None:
        # The model's own rotary module gives cos/sin for every position (any rope type and scaling it knows).
        positions = torch.arange(self.max_context_len, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, 1, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_context_len, head_dim]

    def _project(
        self, li: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, heads, T, D], k and v [N, kv_heads, T, D] for hidden states h [N, T, hidden] of layer ``li``,
        rope applied."""
        attn = self.model.model.layers[li].self_attn
        if self.fused is None:
            return self._project_unfused(attn, h, cos, sin)
        n, t, _ = h.shape
        heads, kv = self.num_heads, self.kv_heads
        fused = self.fused[li]
        qkv = nn.functional.linear(h, fused.qkv_weight, fused.qkv_bias)
        qkv = qkv.view(n, t, heads + 2 * kv, self.head_dim).transpose(1, 2)  # [N, heads + 2 kv, T, D]
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before rope
            q = attn.q_norm(qkv[:, :heads].transpose(1, 2)).transpose(1, 2)
            k = attn.k_norm(qkv[:, heads : heads + kv].transpose(1, 2)).transpose(1, 2)
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qkv[:, : heads + kv]
        qk = _rope(qk, cos, sin)  # one rope over q and k together
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The HF RMSNorm as one ``rms_norm`` call when fused and in float32, where HF's upcast to float32 is a
        no-op and the two compute the same; other dtypes keep HF's own module (it normalises in float32)."""
        if self.fused is None or x.dtype != torch.float32:
            return norm(x)
        return nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    def _project_unfused(
        self, attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, t, _ = h.shape
        q = attn.q_proj(h).view(n, t, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(n, t, self.kv_heads, self.head_dim)
        v = attn.v_proj(h).view(n, t, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp_block(self, li: int, x: torch.Tensor) -> torch.Tensor:
        layer = self.model.model.layers[li]
        h = self._norm(layer.post_attention_layernorm, x)
        gate_up = self.fused[li].gate_up_weight if self.fused is not None else None
        if gate_up is None:
            return x + layer.mlp(h)
        gate, up = nn.functional.linear(h, gate_up).chunk(2, dim=-1)
        return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def _slots(self, blocks: Sequence[int], start: int, end: int) -> tuple[list[int], list[int]]:
        """(block, offset) of positions ``start..end-1`` of a sequence with block table ``blocks``."""
        bs = self.block_size
        return [blocks[p // bs] for p in range(start, end)], [p % bs for p in range(start, end)]

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> list[torch.Tensor]:
        """Run N chunks (right-padded into one batch), write their KV into their blocks, and return float32
        logits at each chunk's ``logit_positions``: a list of N tensors ``[len(logit_positions), vocab]``."""
        n = len(chunks)
        lens = [c.end - c.start for c in chunks]
        t = max(lens)
        self.prefill_tokens_computed += sum(lens)
        ids = torch.zeros(n, t, dtype=torch.long, device=self.device)
        pos = torch.empty(n, t, dtype=torch.long, device=self.device)
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        for i, c in enumerate(chunks):
            ids[i, : lens[i]] = torch.tensor(c.tokens[c.start : c.end], dtype=torch.long)
            pos[i] = torch.arange(c.start, c.start + t).clamp_(max=c.end - 1)  # padding repeats the last one
            blocks, offsets = self._slots(c.blocks, c.start, c.end)
            slot_blocks += blocks
            slot_offsets += offsets
        long = {"dtype": torch.long, "device": self.device}  # explicit: an empty list would make floats
        seq_of = torch.tensor([i for i, m in enumerate(lens) for _ in range(m)], **long)
        step_of = torch.tensor([j for m in lens for j in range(m)], **long)
        dest_blocks = torch.tensor(slot_blocks, **long)
        dest_offsets = torch.tensor(slot_offsets, **long)
        width = max(self.cache.allocator.blocks_for(c.end) for c in chunks)
        index = self.cache.gather_index(self.cache.table_tensor([c.blocks for c in chunks], width))
        ends = torch.tensor([c.end for c in chunks], device=self.device)
        key_pos = torch.arange(width * self.block_size, device=self.device)
        # Causal over the whole sequence (cached prefix included); padded queries' outputs are never read.
        mask = (key_pos.view(1, 1, -1) <= pos.unsqueeze(2)) & (key_pos.view(1, 1, -1) < ends.view(-1, 1, 1))
        mask = mask.unsqueeze(1)  # [N, 1, T, keys]
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [N, 1, T, D]
        x = self.model.model.embed_tokens(ids)
        for li, layer in enumerate(self.model.model.layers):
            q, k, v = self._project(li, self._norm(layer.input_layernorm, x), cos, sin)
            self.cache.write(li, dest_blocks, dest_offsets, k[seq_of, :, step_of], v[seq_of, :, step_of])
            keys, values = self.cache.gather(li, index, n)
            o = nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=self.groups > 1
            )
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(n, t, -1))
            x = self._mlp_block(li, x)
        rows = torch.tensor([i for i, c in enumerate(chunks) for _ in c.logit_positions], **long)
        cols = torch.tensor([p - c.start for c in chunks for p in c.logit_positions], **long)
        hidden = self._norm(self.model.model.norm, x[rows, cols])
        logits = self.model.lm_head(hidden).float()
        return list(torch.split(logits, [len(c.logit_positions) for c in chunks]))

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """One decode step for B sequences: ``tokens`` [B] at ``positions`` [B] (= their KV lengths), with
        block tables ``tables`` that already hold a slot for each new token.

        Writes each token's KV at its position and returns float32 logits [B, vocab] for the next token."""
        b = tokens.shape[0]
        bs = self.block_size
        width = int(positions.max()) // bs + 1
        table = self.cache.table_tensor(tables, width)
        plan = plan_block_range(table, positions, bs) if self.decode_attention != "gathered" else None
        if self.decode_attention == "block_range" and plan is None:
            raise ValueError("decode_attention = 'block_range' but this batch has no block-range plan")
        index = self.cache.gather_index(table) if plan is None else None
        dest_blocks = table.gather(1, (positions // bs).unsqueeze(1)).squeeze(1)
        dest_offsets = positions % bs
        cos = self.cos[positions].view(b, 1, 1, -1)
        sin = self.sin[positions].view(b, 1, 1, -1)
        keep = torch.arange(width * bs, device=self.device).unsqueeze(0) <= positions.unsqueeze(1)
        bias = torch.zeros(b, width * bs, dtype=torch.float32, device=self.device)
        bias = bias.masked_fill_(~keep, float("-inf")).view(b, 1, 1, -1)
        x = self.model.model.embed_tokens(tokens).unsqueeze(1)  # [B, 1, hidden]
        for li, layer in enumerate(self.model.model.layers):
            q, k, v = self._project(li, self._norm(layer.input_layernorm, x), cos, sin)
            self.cache.write(li, dest_blocks, dest_offsets, k[:, :, 0], v[:, :, 0])
            qg = q.reshape(b, self.kv_heads, self.groups, self.head_dim)
            if plan is not None:
                o = attend_block_range(qg, self.cache.k[li], self.cache.v[li], plan, bias, self.scaling)
            else:
                keys, values = self.cache.gather(li, index, b)  # [B, kv_heads, width * bs, D]
                o = attend_gathered(qg, keys, values, bias, self.scaling)
            x = x + layer.self_attn.o_proj(o.reshape(b, 1, self.num_heads * self.head_dim))
            x = self._mlp_block(li, x)
        return self.model.lm_head(self._norm(self.model.model.norm, x[:, 0])).float()
