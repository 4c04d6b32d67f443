"""Log-probs and entropy of sampled tokens from final hidden states, without ever holding ``[tokens, vocab]``.

The policy loss needs, per trained token, ``log softmax(logits / T)[target]`` and (a metric, or an entropy bonus) the entropy of
that tempered distribution. Materialising the logits of a whole micro-batch costs ``N x V`` floats, several
times over (logits, the tempered copy, the log-softmax and its gradient): 10 GB per copy for one 16k-token
sequence with a 152k vocabulary. :func:`token_logprobs` instead runs the lm-head, log-softmax, gather and
entropy over chunks of ``chunk_tokens`` tokens inside one autograd function that keeps only ``[N]`` outputs
(and the ``[N]`` log-normaliser) and recomputes each chunk's logits in backward. Peak extra memory is one
chunk of logits and its softmax, ``2 x chunk_tokens x V`` floats, whatever ``N`` is.

The logits are computed in the weight's dtype (as the model's own lm-head would) and everything after them in
float32, so the values and gradients equal the full-logits path (``log_softmax(lm_head(h).float() / T)``) to
float32 rounding. Under FSDP2 the caller passes the lm-head's parameters as the root module exposes them after
its forward (unsharded: the root does not reshard after forward); the gradient this function returns for them
then accumulates into the unsharded parameter and FSDP2 reduce-scatters it as usual.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.nn import functional as F


def _tempered_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: Tensor) -> Tensor:
    """``hidden [c, H]`` -> float32 ``[c, V]`` logits divided by each token's temperature.

    The matmul runs in the weight's dtype (bf16 under mixed precision, where the hidden states may come back
    in float32), as the model's own lm-head would run it."""
    return F.linear(hidden.to(weight.dtype), weight, bias).float().div_(temperature[:, None])


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Chunked lm-head + log-softmax + gather + entropy; see :func:`token_logprobs`."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: Tensor,
        chunk: int,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)  # log-normaliser per token: backward's softmax needs no second reduction
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _tempered_logits(hidden[s:e], weight, bias, temperature[s:e])
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            p = (z - lse[s:e, None]).exp_()
            # H = lse - sum_v p_v z_v; a batched dot product, so no third [c, V] block is made
            entropy[s:e] = lse[s:e] - (p[:, None, :] @ z[:, :, None]).flatten()
            del z, p
        ctx.save_for_backward(hidden, weight, bias, targets, temperature, lse, entropy)
        ctx.chunk = chunk
        # an output the loss does not use gets None, not a zero tensor: the entropy term is then skipped
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, temperature, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, chunk = hidden.shape[0], ctx.chunk
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_h = torch.zeros_like(hidden) if need_h else None
        # accumulated over chunks in float32 whatever the weight's dtype, cast once at the end
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            g = grad_logp[s:e].float() / temperature[s:e]  # d logp / dlogits = (onehot - softmax) / T
            d = _tempered_logits(hidden[s:e], weight, bias, temperature[s:e]).sub_(lse[s:e, None])  # log p
            if grad_entropy is not None:
                # dH/dz_v = -p_v (log p_v + H): folded into one [c, V] block with the log-prob term
                ge = grad_entropy[s:e].float() / temperature[s:e]
                p = d.exp()
                d.add_(entropy[s:e, None]).mul_(-ge[:, None]).sub_(g[:, None]).mul_(p)
                del p
            else:
                d.exp_().mul_(-g[:, None])
            d[torch.arange(e - s, device=d.device), targets[s:e]] += g
            if grad_h is not None:
                grad_h[s:e] = d.to(weight.dtype) @ weight  # cast to hidden's dtype by the copy
            if grad_w is not None:
                grad_w.addmm_(d.t(), hidden[s:e].float())
            if grad_b is not None:
                grad_b += d.sum(0)
            del d
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: Tensor,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and entropy of each tempered distribution, ``chunk_tokens`` tokens at a time.

    ``hidden [N, H]``: the final hidden state (after the final norm) that predicts each target;
    ``weight [V, H]`` and ``bias [V] | None``: the lm-head; ``targets`` long ``[N]``; ``temperature [N]``
    (> 0) per token. Returns float32 ``(logp [N], entropy [N])`` with ``logp = log_softmax(z)[target]`` and
    ``entropy = -sum softmax(z) log_softmax(z)`` for ``z = (hidden @ weight.T + bias) / temperature``.
    Both carry gradients to ``hidden``, ``weight`` and ``bias`` (the entropy's for an entropy bonus; a loss
    that leaves it out pays nothing for it in backward).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens = {chunk_tokens} must be at least 1")
    n = hidden.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [N, H] for weight {tuple(weight.shape)} [V, H]"
        )
    if targets.shape != (n,) or temperature.shape != (n,):
        raise ValueError(
            f"targets {tuple(targets.shape)} and temperature {tuple(temperature.shape)} must both be [{n}]"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
    return _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, temperature.float(), chunk_tokens)
