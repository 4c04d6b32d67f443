"""The built-in engine's model runner against the Hugging Face forward of the same weights: prefill and decode
logits for each supported decoder family (Qwen2: q/k/v biases; Llama: none; Qwen3: per-head q/k norms), and the
fused projections following a weight update copied into the HF parameters by name."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rollout_fleet.engine.runner import ModelRunner

SHAPE = dict(
    vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=128, head_dim=16,
)  # fmt: skip
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def build(family: str, seed: int) -> torch.nn.Module:
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SHAPE)).eval()
    with torch.no_grad():  # HF zero-initialises biases and norms; random ones make a wrong split visible
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def generate_logits(runner: ModelRunner, seqs: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill ``seqs`` then decode ``steps`` teacher-forced tokens; per step the logits [B, vocab]."""
    b = len(seqs)
    out = [torch.stack([lg[0] for lg in runner.prefill(list(range(b)), seqs, [[len(s) - 1] for s in seqs])])]
    positions = torch.tensor([len(s) for s in seqs])
    for step in range(steps):
        tokens = torch.tensor([(7 * i + 3 * step) % 60 + 2 for i in range(b)])
        out.append(runner.decode(tokens, positions))
        for i in range(b):
            seqs[i] = [*seqs[i], int(tokens[i])]
        positions = positions + 1
    return out


def reference_logits(
    model: torch.nn.Module, seqs: list[list[int]], prompt_lens: list[int]
) -> list[torch.Tensor]:
    """The HF forward of each whole sequence, at the positions ``generate_logits`` reads."""
    steps = len(seqs[0]) - prompt_lens[0]
    rows = []
    with torch.no_grad():
        for seq, n in zip(seqs, prompt_lens, strict=True):
            logits = model(torch.tensor([seq])).logits[0].float()
            rows.append(logits[n - 1 : n + steps])
    return [torch.stack([r[k] for r in rows]) for k in range(steps + 1)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_match_the_hf_forward(family: str, fused: bool) -> None:
    model = build(family, 0)
    runner = ModelRunner(model, max_rows=4, max_context_len=64, fuse_projections=fused)
    seqs = [[5, 9, 11, 3], [8, 2, 2, 7, 30, 1], [4, 4]]
    lens = [len(s) for s in seqs]
    got = generate_logits(runner, seqs, steps=5)
    for g, want in zip(got, reference_logits(model, seqs, lens), strict=True):
        torch.testing.assert_close(g, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_weight_update_copied_into_the_hf_parameters_reaches_the_fused_projections(family: str) -> None:
    model, other = build(family, 0), build(family, 1)
    runner = ModelRunner(model, max_rows=4, max_context_len=64)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in other.state_dict().items():
            if name in params:
                params[name].copy_(tensor)  # what Engine.load_weights does
    seqs = [[5, 9, 11, 3], [8, 2, 2, 7, 30, 1]]
    lens = [len(s) for s in seqs]
    got = generate_logits(runner, seqs, steps=3)
    for g, want in zip(got, reference_logits(other, seqs, lens), strict=True):
        torch.testing.assert_close(g, want, atol=2e-5, rtol=1e-4)
    # the parameters are views of the fused matrices, not copies of them
    layer = model.model.layers[0]
    fused = runner.fused[0]
    assert (
        layer.self_attn.k_proj.weight.data_ptr()
        == fused.qkv_weight[SHAPE["num_attention_heads"] * 16].data_ptr()
    )
    assert layer.mlp.up_proj.weight.data_ptr() == fused.gate_up_weight[SHAPE["intermediate_size"]].data_ptr()
