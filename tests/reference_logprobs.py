"""The full-logits reference the learner's chunked loss is checked against (tests and benchmarks only).

The learner never materialises ``[tokens, vocab]`` logits (``learner.logprobs``); these functions do, on
purpose, in the most direct way, so that they are easy to trust.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def gather_logprobs(logits: Tensor, input_ids: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """``logits [b, L, V]``, ``input_ids [b, L]`` -> ``[b, L]``: at position t, log p(token t | tokens < t).

    ``temperature`` is a float or a per-row ``[b, 1, 1]`` tensor. Computed from the logits at t - 1 as
    ``log_softmax(logits / temperature)``, the quantity the engine reports for a sampled token; position 0 is 0.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} disagree")
    scaled = logits[:, :-1].float() / temperature
    picked = scaled.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    token_logp = picked - torch.logsumexp(scaled, dim=-1)
    return torch.cat([token_logp.new_zeros(token_logp.shape[0], 1), token_logp], dim=1)


def full_token_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: Tensor
) -> tuple[Tensor, Tensor]:
    """``learner.logprobs.token_logprobs`` through the full ``[N, V]`` logits: ``(logp [N], entropy [N])``."""
    logp_all = torch.log_softmax(F.linear(hidden, weight, bias).float() / temperature[:, None], dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(1, targets[:, None]).squeeze(1), entropy
