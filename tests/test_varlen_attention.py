"""The varlen-kernel path of the packed attention (flash-attention's on CUDA): its index maps gather every
sample's tokens without padding and give each row position the same output, and the same gradients, as the
SDPA-bucket path. On CPU :func:`reference_varlen_kernel` stands in for the CUDA kernel; the kernel itself is
checked against it in the ``gpu`` test."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import learner.attention as attention
from common.configlib import ConfigError
from learner.attention import (
    PACKED_ATTENTION,
    PACKED_FLASH_ATTENTION,
    packed_attention,
    reference_varlen_kernel,
    register_packed_attention,
    resolve_attention_kernel,
    varlen_attention,
)
from learner.packing import TrainSequence, collate, share_prompts
from learner.step import sample_logprobs

torch.set_num_threads(1)
HEADS, KV_HEADS, DIM = 4, 2, 8


def _seq(prompt: list[int], n_out: int, index: int) -> TrainSequence:
    g = torch.Generator().manual_seed(index)
    return TrainSequence(
        prompt_ids=torch.tensor(prompt),
        output_ids=torch.randint(1, 60, (n_out,), generator=g),
        logprobs=-torch.rand(n_out, generator=g),
        versions=torch.zeros(n_out, dtype=torch.long),
        loss_mask=torch.ones(n_out),
        advantages=float(index % 3 - 1),
        index=index,
    )


def _samples() -> list[TrainSequence]:
    # a group of three sharing a 5-token prompt, a plain sequence, and a pair sharing a 2-token prompt
    group, pair = [3, 4, 5, 6, 7], [9, 8]
    lengths = [(group, 4), (group, 9), (group, 1), ([11, 12, 13], 6), (pair, 3), (pair, 12)]
    return [_seq(p, n, i) for i, (p, n) in enumerate(lengths)]


class _Heads(torch.nn.Module):
    """The attributes transformers' SDPA reads from an attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


@pytest.mark.parametrize("varlen", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_varlen_maps_equal_the_bucketed_attention(varlen: bool, shared: bool) -> None:
    seqs = _samples()
    rows = share_prompts(seqs, token_budget=10_000) if shared else None
    packed = collate(seqs, rows=rows, varlen=varlen).packed
    lengths = [seqs[i].length for i in packed.order.tolist()]
    # the concatenation holds every sample's tokens once, longest first, with no padding
    assert packed.cu_seqlens.tolist() == [sum(lengths[:k]) for k in range(len(lengths) + 1)]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.max_seqlen == max(lengths) == 14
    assert packed.varlen_index.numel() == sum(s.length for s in seqs)
    first = int(packed.order[0])
    torch.testing.assert_close(packed.varlen_index[: lengths[0]], packed.source[first, : lengths[0]])

    r, width = packed.input_ids.shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(r, HEADS, width, DIM, generator=g, requires_grad=True)
    k = torch.randn(r, KV_HEADS, width, DIM, generator=g, requires_grad=True)
    v = torch.randn(r, KV_HEADS, width, DIM, generator=g, requires_grad=True)
    grad_out = torch.randn(r, width, HEADS, DIM, generator=g)
    maps = {"packed_source": packed.source, "packed_target": packed.target, "packed_order": packed.order,
            "packed_buckets": packed.buckets}  # fmt: skip
    buckets, _ = packed_attention(_Heads(), q, k, v, None, scaling=0.3, **maps)
    (buckets * grad_out).sum().backward()
    want = [buckets.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
    for x in (q, k, v):
        x.grad = None
    out = varlen_attention(q, k, v, packed.varlen, reference_varlen_kernel, scaling=0.3)
    (out * grad_out).sum().backward()
    for got, expected in zip([out.detach(), q.grad, k.grad, v.grad], want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _model(implementation: str) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(register_packed_attention(implementation))
    return model


def test_the_flash_implementation_trains_like_the_sdpa_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # the whole learner forward and backward through the varlen implementation, the CUDA kernel replaced by
    # its plain-torch equivalent (the kernel alone is checked on a GPU below)
    monkeypatch.setattr(attention, "flash_varlen_kernel", reference_varlen_kernel)
    seqs = _samples()
    mb = collate(seqs, rows=share_prompts(seqs, token_budget=10_000))
    temps = torch.full((len(seqs),), 0.9)
    results = []
    for implementation in (PACKED_ATTENTION, PACKED_FLASH_ATTENTION):
        model = _model(implementation)
        logp, entropy = sample_logprobs(model, mb, temps, chunk_tokens=7)
        (logp.sum() + entropy.sum()).backward()
        results.append([logp.detach(), entropy.detach(), *(p.grad for p in model.parameters())])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_kernel_setting_resolves_by_device() -> None:
    cpu = torch.device("cpu")
    assert resolve_attention_kernel("auto", cpu, None) == PACKED_ATTENTION
    assert resolve_attention_kernel("sdpa", cpu, torch.bfloat16) == PACKED_ATTENTION
    with pytest.raises(ConfigError, match=r"learner.attention_kernel = 'flash_varlen'.*CUDA only"):
        resolve_attention_kernel("flash_varlen", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown packed attention implementation 'eager'"):
        register_packed_attention("eager")


@pytest.mark.gpu
def test_flash_attention_varlen_kernel_equals_the_reference_on_cuda() -> None:
    try:
        import flash_attn  # noqa: F401
    except ImportError as exc:
        raise AssertionError("this GPU check needs flash-attn: pip install -e '.[flash]'") from exc
    device = torch.device("cuda")
    assert resolve_attention_kernel("auto", device, torch.bfloat16) == PACKED_FLASH_ATTENTION
    packed = collate(_samples(), varlen=True).packed.to(device)
    g = torch.Generator(device=device).manual_seed(0)
    n = packed.varlen_index.numel()
    q = torch.randn(n, HEADS, 64, generator=g, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(n, KV_HEADS, 64, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    args = (packed.cu_seqlens, packed.max_seqlen, 0.125)
    flash = attention.flash_varlen_kernel(q, k, v, *args)
    reference = reference_varlen_kernel(q.float(), k.float(), v.float(), *args)
    torch.testing.assert_close(flash.float(), reference, atol=2e-2, rtol=2e-2)
