"""Batched prefill and decode of a Hugging Face decoder-only model over a row-slotted KV cache.

Why not HF's cache classes: continuous batching needs sequences that join and leave a running batch between
steps, each with its own length. HF's caches assume one padded batch that lives and dies together. This module
runs the HF model's own modules (norms, output and down projections, rotary tables) in its own attention loop,
so the weights stay the HF model's parameters (``load_weights`` is a copy by HF name) and a teacher-forced
forward of the same HF model gives the same log-probs. The q/k/v and gate/up projections run as one matrix each
(:func:`fuse_layer`); their HF parameters become views of those matrices, so a copy by name updates them.

The KV cache holds one row per running sequence: per layer ``[rows, kv_heads, length, head_dim]``. Rows stay
compact (the running batch is rows ``0..B-1``; a freed row is filled by moving the last one), so a decode step
attends over a view of the first B rows with a length mask, and nothing is gathered or re-laid-out per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the built-in engine's forward implements."""


class KVCache:
    """Key/value buffers per layer, ``[rows, kv_heads, length, head_dim]``, grown by doubling as needed."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        max_rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_rows, self.max_len = max_rows, max_len
        self.dtype, self.device = dtype, device
        self.reset()

    def reset(self) -> None:
        """Drop every buffer back to a small allocation (used by flush and after errors)."""
        self.rows = min(4, self.max_rows)
        self.length = min(64, self.max_len)
        self.k = [self._empty(self.rows, self.length) for _ in range(self.num_layers)]
        self.v = [self._empty(self.rows, self.length) for _ in range(self.num_layers)]

    def _empty(self, rows: int, length: int) -> torch.Tensor:
        return torch.zeros(rows, self.kv_heads, length, self.head_dim, dtype=self.dtype, device=self.device)

    def reserve(self, rows: int, length: int) -> None:
        """Make room for ``rows`` sequences of ``length`` tokens, keeping the contents."""
        if rows > self.max_rows or length > self.max_len:
            raise ValueError(
                f"KV cache request {rows} rows x {length} tokens exceeds {self.max_rows} x {self.max_len}"
            )
        if rows <= self.rows and length <= self.length:
            return
        new_rows = min(self.max_rows, max(rows, 2 * self.rows if rows > self.rows else self.rows))
        new_len = min(self.max_len, max(length, 2 * self.length if length > self.length else self.length))
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                grown = self._empty(new_rows, new_len)
                grown[: self.rows, :, : self.length].copy_(old)
                store[i] = grown
        self.rows, self.length = new_rows, new_len

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (compaction)."""
        for store in (self.k, self.v):
            for buf in store:
                buf[dst, :, :length].copy_(buf[src, :, :length])

    def bytes(self) -> int:
        return 2 * self.num_layers * self.k[0].numel() * self.k[0].element_size()


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


class ModelRunner:
    """Prefill and decode over the HF model's modules with a :class:`KVCache` (inference only)."""

    def __init__(
        self, model: nn.Module, *, max_rows: int, max_context_len: int, fuse_projections: bool = True
    ) -> None:
        check_architecture(model)
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
        self.cache = KVCache(
            len(model.model.layers),
            self.kv_heads,
            self.head_dim,
            max_rows=max_rows,
            max_len=max_context_len,
            dtype=self.dtype,
            device=self.device,
        )
        self._build_rope_table()
        # None: the HF modules' own projections, one matrix product each (the baseline of
        # benchmarks/engine_decode.py)
        self.fused = [fuse_layer(layer) for layer in model.model.layers] if fuse_projections else None
        self.prefill_tokens_computed = 0  # tokens run through the model by prefill (copies excepted)

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

    @torch.inference_mode()
    def prefill(
        self, rows: Sequence[int], seqs: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Run N sequences (right-padded into one batch), write their KV into ``rows``, and return float32
        logits at the requested positions of each sequence: a list of N tensors [len(positions[i]), vocab].

        Identical sequences (the samples of a group arrive with the same prompt) are computed once and their
        KV copied to the other rows: the results are the same, the prefill work is one prompt's."""
        copies: dict[tuple[int, ...], list[int]] = {}
        for i, seq in enumerate(seqs):
            copies.setdefault(tuple(seq), []).append(i)
        if len(copies) == len(seqs):
            return self._prefill(rows, seqs, positions)
        members = list(copies.values())
        wanted = [sorted({p for i in m for p in positions[i]}) for m in members]
        logits = self._prefill([rows[m[0]] for m in members], [seqs[m[0]] for m in members], wanted)
        self.cache.reserve(max(rows) + 1, max(len(s) for s in seqs))
        out: list[torch.Tensor] = [logits[0]] * len(seqs)
        for m, pos, lg in zip(members, wanted, logits, strict=True):
            where = {p: k for k, p in enumerate(pos)}
            for i in m:
                if i != m[0]:
                    self.cache.move_row(rows[m[0]], rows[i], len(seqs[i]))
                out[i] = lg[[where[p] for p in positions[i]]]
        return out

    def _prefill(
        self, rows: Sequence[int], seqs: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        n, t = len(seqs), max(len(s) for s in seqs)
        self.cache.reserve(max(rows) + 1, t)
        self.prefill_tokens_computed += sum(len(s) for s in seqs)
        ids = torch.zeros(n, t, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        lens = torch.tensor([len(s) for s in seqs], device=self.device)
        ar = torch.arange(t, device=self.device)
        # Causal, and no query attends to padding keys; padded queries' outputs are never read.
        mask = (ar.unsqueeze(0) <= ar.unsqueeze(1)).unsqueeze(0) & (
            ar.unsqueeze(0) < lens.unsqueeze(1)
        ).unsqueeze(1)
        mask = mask.unsqueeze(1)  # [N, 1, T, T]
        cos, sin = self.cos[:t].view(1, 1, t, -1), self.sin[:t].view(1, 1, t, -1)
        row_index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        x = self.model.model.embed_tokens(ids)
        for li, layer in enumerate(self.model.model.layers):
            q, k, v = self._project(li, self._norm(layer.input_layernorm, x), cos, sin)
            self.cache.k[li][row_index, :, :t] = k
            self.cache.v[li][row_index, :, :t] = v
            o = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=self.groups > 1
            )
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(n, t, -1))
            x = self._mlp_block(li, x)
        seq_index = torch.tensor([i for i, ps in enumerate(positions) for _ in ps], device=self.device)
        pos_index = torch.tensor([p for ps in positions for p in ps], device=self.device)
        hidden = self._norm(self.model.model.norm, x[seq_index, pos_index])
        logits = self.model.lm_head(hidden).float()
        return list(torch.split(logits, [len(ps) for ps in positions]))

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step for rows 0..B-1: ``tokens`` [B] at ``positions`` [B] (= their KV lengths).

        Writes each token's KV at its position and returns float32 logits [B, vocab] for the next token."""
        b = tokens.shape[0]
        length = int(positions.max()) + 1
        self.cache.reserve(b, length)
        rows = torch.arange(b, device=self.device)
        cos = self.cos[positions].view(b, 1, 1, -1)
        sin = self.sin[positions].view(b, 1, 1, -1)
        keep = torch.arange(length, device=self.device).unsqueeze(0) <= positions.unsqueeze(1)
        bias = torch.zeros(b, length, dtype=torch.float32, device=self.device)
        bias = bias.masked_fill_(~keep, float("-inf")).view(b, 1, 1, length)
        x = self.model.model.embed_tokens(tokens).unsqueeze(1)  # [B, 1, hidden]
        for li, layer in enumerate(self.model.model.layers):
            q, k, v = self._project(li, self._norm(layer.input_layernorm, x), cos, sin)
            kc, vc = self.cache.k[li], self.cache.v[li]
            kc[rows, :, positions] = k[:, :, 0]
            vc[rows, :, positions] = v[:, :, 0]
            keys, values = kc[:b, :, :length], vc[:b, :, :length]  # views, no copy
            qg = q.reshape(b, self.kv_heads, self.groups, self.head_dim)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scaling + bias
            probs = torch.softmax(scores, dim=-1).to(self.dtype)
            o = torch.matmul(probs, values).reshape(b, 1, self.num_heads * self.head_dim)
            x = x + layer.self_attn.o_proj(o)
            x = self._mlp_block(li, x)
        return self.model.lm_head(self._norm(self.model.model.norm, x[:, 0])).float()
