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

from rollout_fleet.engine.runner import ModelRunner, PrefillChunk

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
    tables = [runner.cache.allocate(runner.cache.allocator.blocks_for(len(s) + steps)) for s in seqs]
    chunks = [PrefillChunk(t, s, 0, len(s), [len(s) - 1]) for t, s in zip(tables, seqs, strict=True)]
    out = [torch.stack([lg[0] for lg in runner.prefill(chunks)])]
    positions = torch.tensor([len(s) for s in seqs])
    for step in range(steps):
        tokens = torch.tensor([(7 * i + 3 * step) % 60 + 2 for i in range(b)])
        out.append(runner.decode(tokens, positions, tables))
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
    runner = ModelRunner(
        model, max_context_len=64, max_total_tokens=256, block_size=4, fuse_projections=fused
    )
    seqs = [[5, 9, 11, 3], [8, 2, 2, 7, 30, 1], [4, 4]]
    lens = [len(s) for s in seqs]
    got = generate_logits(runner, seqs, steps=5)
    for g, want in zip(got, reference_logits(model, seqs, lens), strict=True):
        torch.testing.assert_close(g, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_weight_update_copied_into_the_hf_parameters_reaches_the_fused_projections(family: str) -> None:
    model, other = build(family, 0), build(family, 1)
    runner = ModelRunner(model, max_context_len=64, max_total_tokens=256, block_size=4)
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


def hf_logits(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def test_chunked_prefill_and_prefix_reuse_match_the_hf_forward() -> None:
    """Chunks that end mid-block, and a second sequence that starts on the first one's cached blocks, give the
    logits of one whole forward: each chunk attends to the KV the earlier ones left in the blocks."""
    model = build("qwen2", 0)
    bs = 4
    runner = ModelRunner(model, max_context_len=64, max_total_tokens=128, block_size=bs)
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(2, 60, (23,), generator=gen).tolist()
    table = runner.cache.allocate(6)
    got = []
    for start, end in ((0, 5), (5, 14), (14, 23)):  # boundaries inside blocks
        got.append(runner.prefill([PrefillChunk(table, seq, start, end, list(range(start, end)))])[0])
    want = hf_logits(model, seq)
    torch.testing.assert_close(torch.cat(got), want, atol=2e-5, rtol=1e-4)
    # A second sequence sharing the first 3 blocks (12 tokens) computes only its own tail.
    other = seq[:12] + torch.randint(2, 60, (9,), generator=gen).tolist()
    runner.cache.allocator.share(table[:3])
    other_table = table[:3] + runner.cache.allocate(3)
    computed = runner.prefill_tokens_computed
    (tail,) = runner.prefill([PrefillChunk(other_table, other, 12, 21, list(range(12, 21)))])
    assert runner.prefill_tokens_computed - computed == 9
    torch.testing.assert_close(tail, hf_logits(model, other)[12:], atol=2e-5, rtol=1e-4)
    # Both decode on, in one batch, over their shared blocks (tail blocks private).
    tokens, positions = torch.tensor([7, 9]), torch.tensor([23, 21])
    step = runner.decode(tokens, positions, [table, other_table])
    torch.testing.assert_close(step[0], hf_logits(model, [*seq, 7])[-1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(step[1], hf_logits(model, [*other, 9])[-1], atol=2e-5, rtol=1e-4)


def test_scattered_block_tables_and_a_copied_partial_block_match_the_hf_forward() -> None:
    """Blocks in any order of the pool; a sharer of a prompt whose last block is partial decodes on its own copy
    of that block while the owner writes into the original."""
    model = build("llama", 0)
    bs = 4
    runner = ModelRunner(model, max_context_len=64, max_total_tokens=64, block_size=bs)
    cache = runner.cache
    cache.allocate(cache.allocator.capacity_blocks)  # zero every block, then hand them out out of order
    cache.allocator.release(list(range(1, cache.num_blocks)))
    prompt = [5, 9, 11, 3, 8, 2, 2, 7, 30, 1]  # 2 full blocks + 2 tokens
    owner = [14, 3, 9]
    (lg,) = runner.prefill([PrefillChunk(owner, prompt, 0, len(prompt), [len(prompt) - 1])])
    sharer = owner[:2] + [6]
    cache.copy_block(owner[2], 6, len(prompt) % bs)
    seqs = [list(prompt), list(prompt)]
    positions = torch.tensor([len(prompt)] * 2)
    for step in range(4):
        if positions[0] % bs == 0:  # a new block each, far apart
            owner.append(11)
            sharer.append(2)
        tokens = torch.tensor([20 + step, 40 - step])
        logits = runner.decode(tokens, positions, [owner, sharer])
        for i in range(2):
            seqs[i].append(int(tokens[i]))
            torch.testing.assert_close(logits[i], hf_logits(model, seqs[i])[-1], atol=2e-5, rtol=1e-4)
        positions = positions + 1
    torch.testing.assert_close(lg[0], hf_logits(model, prompt)[-1], atol=2e-5, rtol=1e-4)


def test_a_pool_smaller_than_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match=r"engine.max_total_tokens = 8 is smaller than one KV block"):
        ModelRunner(build("qwen2", 0), max_context_len=64, max_total_tokens=8, block_size=16)


@pytest.mark.parametrize("attention", ["gathered", "block_range"])
def test_both_decode_attentions_match_the_hf_forward(attention: str) -> None:
    """Ragged lengths, a prompt shared by two sequences (two query slots on its blocks) and blocks taken from
    all over the pool: the block-range attention and the gathered one give the HF forward's logits."""
    model = build("qwen2", 2)
    bs = 4
    runner = ModelRunner(model, max_context_len=128, max_total_tokens=512, block_size=bs)
    runner.decode_attention = attention
    cache = runner.cache
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 60, (36,), generator=gen).tolist()  # 9 full blocks
    solo = torch.randint(2, 60, (45,), generator=gen).tolist()
    cache.allocate(60)  # push the tables apart in the pool
    first = cache.allocate(10)
    gap = cache.allocate(3)
    solo_table = cache.allocate(13)
    cache.allocator.release(gap)
    runner.prefill([PrefillChunk(first, shared, 0, 36, [35]), PrefillChunk(solo_table, solo, 0, 45, [44])])
    cache.allocator.share(first[:9])
    second = first[:9] + (cache.allocate(1) or [])  # shares all 9 full blocks
    seqs = [list(shared), list(shared), list(solo)]
    tables = [first, second, solo_table]
    for step in range(6):
        tokens = torch.tensor([3 + step, 50 - step, 17 + step])
        positions = torch.tensor([len(s) for s in seqs])
        for i, table in enumerate(tables):
            if positions[i] // bs >= len(table):
                table.extend(cache.allocate(1) or [])
        logits = runner.decode(tokens, positions, tables)
        for i in range(3):
            seqs[i].append(int(tokens[i]))
            torch.testing.assert_close(logits[i], hf_logits(model, seqs[i])[-1], atol=2e-5, rtol=1e-4)
