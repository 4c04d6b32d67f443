"""The chunked lm-head loss (``learner.logprobs.token_logprobs``): values and gradients by hand and against
the full-logits reference, and its memory bound (no op ever makes more than one chunk of logits)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from learner.logprobs import token_logprobs
from tests.reference_logprobs import full_token_logprobs

torch.set_num_threads(1)


def test_by_hand() -> None:
    # h = [1], w = [[0], [ln 3]], bias [0, 0]: logits [0, ln 3], so p = [0.25, 0.75]
    h = torch.tensor([[1.0], [1.0]], requires_grad=True)
    w = torch.tensor([[0.0], [math.log(3.0)]], requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    targets = torch.tensor([1, 1])
    temps = torch.tensor([1.0, 2.0])  # at T = 2 the logits are [0, ln3 / 2]: p(1) = sqrt3 / (1 + sqrt3)
    logp, entropy = token_logprobs(h, w, b, targets, temps, chunk_tokens=1)
    q = math.sqrt(3.0) / (1 + math.sqrt(3.0))
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75), math.log(q)]))
    ent = [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), -(q * math.log(q) + (1 - q) * math.log(1 - q))]
    torch.testing.assert_close(entropy, torch.tensor(ent))
    assert entropy.requires_grad
    logp[0].backward()  # d logp / d logits = onehot - p = [-0.25, 0.25]
    torch.testing.assert_close(h.grad, torch.tensor([[0.25 * math.log(3.0)], [0.0]]))
    torch.testing.assert_close(w.grad, torch.tensor([[-0.25], [0.25]]))
    torch.testing.assert_close(b.grad, torch.tensor([-0.25, 0.25]))


def _case(n: int, v: int = 50, h: int = 8, bias: bool = True, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    b = torch.randn(v, generator=g) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    temps = 0.5 + torch.rand(n, generator=g)  # a temperature per token (rows of different samples)
    upstream = torch.randn(n, generator=g)  # a loss that weights every token differently
    return hidden, weight, b, targets, temps, upstream


def _grads(fn, hidden, weight, bias, targets, temps, upstream, entropy_weight=None):  # noqa: ANN001, ANN202
    """Values and the gradients of ``sum(upstream * logp) (+ sum(entropy_weight * entropy))``."""
    leaves = [x.clone().requires_grad_() for x in (hidden, weight) + ((bias,) if bias is not None else ())]
    logp, entropy = fn(leaves[0], leaves[1], leaves[2] if bias is not None else None, targets, temps)
    loss = (logp * upstream).sum()
    if entropy_weight is not None:
        loss = loss + (entropy * entropy_weight).sum()
    loss.backward()
    return logp.detach(), entropy.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize(
    "n,chunk,bias",
    [(37, 8, True), (37, 37, True), (37, 64, False), (5, 1, True), (1, 4, True), (64, 16, False)],
)  # chunks that do not divide N, N < chunk, one token per chunk, an exact division
def test_equals_the_full_logits_path(n: int, chunk: int, bias: bool) -> None:
    case = _case(n, bias=bias, seed=n + chunk)
    want = _grads(full_token_logprobs, *case)
    got = _grads(lambda *a: token_logprobs(*a, chunk_tokens=chunk), *case)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    # The entropy sums V float32 terms in another order than the reference's -(p log p).sum(): 1.2e-5 apart on a
    # value of 0.6 for one case with the packages a fresh install resolved on 2026-12-02 (within 1e-5 before).
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=5e-5)
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert all(float(g.abs().max()) > 1e-3 for g in got[2])  # the gradients are not trivially zero


@pytest.mark.parametrize("n,chunk,bias", [(37, 8, True), (5, 1, False), (16, 64, True)])
def test_entropy_gradient_equals_the_full_logits_path(n: int, chunk: int, bias: bool) -> None:
    """An entropy bonus differentiates the entropy output too: dH/dz = -p (log p + H), per chunk."""
    case = _case(n, bias=bias, seed=3 * n + chunk)
    weight_h = torch.randn(n, generator=torch.Generator().manual_seed(n))
    want = _grads(full_token_logprobs, *case, entropy_weight=weight_h)
    got = _grads(lambda *a: token_logprobs(*a, chunk_tokens=chunk), *case, entropy_weight=weight_h)
    only_logp = _grads(lambda *a: token_logprobs(*a, chunk_tokens=chunk), *case)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    for g, w, lp in zip(got[2], want[2], only_logp[2], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)  # float32 rounding of gradients near 5
        assert float((g - lp).abs().max()) > 1e-3  # the entropy term changed the gradient


def test_entropy_gradient_by_hand() -> None:
    # logits [0, ln 3]: p = [1/4, 3/4], H = -(p0 log p0 + p1 log p1); dH/dz_v = -p_v (log p_v + H)
    h = torch.tensor([[1.0]], requires_grad=True)
    w = torch.tensor([[0.0], [math.log(3.0)]], requires_grad=True)
    _, entropy = token_logprobs(h, w, None, torch.tensor([1]), torch.tensor([1.0]), chunk_tokens=1)
    entropy.sum().backward()
    p = [0.25, 0.75]
    big_h = -sum(q * math.log(q) for q in p)
    dz = [-q * (math.log(q) + big_h) for q in p]
    torch.testing.assert_close(w.grad, torch.tensor([[dz[0]], [dz[1]]]))  # dz/dw_v = h = 1
    torch.testing.assert_close(h.grad, torch.tensor([[dz[1] * math.log(3.0)]]))


def test_no_tokens_gives_empty_outputs_and_zero_gradients() -> None:
    hidden, weight, _, _, _, _ = _case(0)
    weight.requires_grad_()
    logp, entropy = token_logprobs(hidden, weight, None, torch.zeros(0, dtype=torch.long), torch.ones(0), 4)
    assert logp.shape == entropy.shape == (0,)
    logp.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_bf16_weight_with_float32_hidden_states() -> None:
    """Under bf16 mixed precision the lm-head weight is bf16 and the root returns float32 hidden states: the
    matmul runs in bf16 as the model's lm-head would, the softmax in float32, each gradient in its input's
    dtype."""
    hidden, weight, _, targets, temps, upstream = _case(20)
    w16 = weight.bfloat16().requires_grad_()
    h = hidden.clone().requires_grad_()
    logp, _ = token_logprobs(h, w16, None, targets, temps, chunk_tokens=6)
    (logp * upstream).sum().backward()
    assert logp.dtype == torch.float32 and h.grad.dtype == torch.float32 and w16.grad.dtype == torch.bfloat16
    ref, _ = full_token_logprobs(hidden.bfloat16(), w16.detach(), None, targets, temps)
    torch.testing.assert_close(logp.detach(), ref, atol=1e-5, rtol=0)


class _LargestOutput(TorchDispatchMode):
    """Records the most elements any single op returns (forward and backward run on this thread on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _peak(fn, n: int, v: int, h: int) -> tuple[int, int]:  # noqa: ANN001
    hidden, weight, _, targets, temps, upstream = _case(n, v=v, h=h, bias=False)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved = []
    with _LargestOutput() as mode:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            logp, _ = fn(hidden, weight, None, targets, temps)
        (logp * upstream).sum().backward()
    return mode.largest, max(saved)


def test_memory_holds_one_chunk_of_logits_whatever_the_length() -> None:
    v, h, chunk = 1000, 16, 64
    for n in (256, 1024):
        largest, saved = _peak(lambda *a: token_logprobs(*a, chunk_tokens=chunk), n, v, h)
        assert largest <= max(chunk * v, v * h), (n, largest)  # one chunk's logits, or the weight's gradient
        assert saved <= max(n * h, v * h), (n, saved)  # backward keeps the inputs, never logits
    full_largest, full_saved = _peak(full_token_logprobs, 1024, v, h)
    assert full_largest >= 1024 * v and full_saved >= 1024 * v  # the reference does hold [N, V]


def test_bad_arguments_are_refused() -> None:
    hidden, weight, _, targets, temps, _ = _case(4)
    with pytest.raises(ValueError, match="chunk_tokens = 0"):
        token_logprobs(hidden, weight, None, targets, temps, 0)
    with pytest.raises(ValueError, match=r"targets \(3,\)"):
        token_logprobs(hidden, weight, None, targets[:3], temps, 2)
    with pytest.raises(ValueError, match="must be \\[N, H\\]"):
        token_logprobs(hidden[:, :3], weight, None, targets, temps, 2)
