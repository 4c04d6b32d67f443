"""Batched sampling with per-row parameters, and the log-probs SGLang returns.

The returned log-prob of a token is ``log_softmax(logits / T)[token]`` for sampled rows and
``log_softmax(logits)[token]`` for greedy rows (T < 1e-6), computed before top-k / top-p / min-p truncation and
not renormalised after it: exactly what SGLang's ``layers/sampler.py`` returns by default.

Sampling draws one uniform number per row and inverts the (filtered) CDF. A request with ``sampling_seed`` has
its own ``torch.Generator`` and consumes exactly one number per generated token, so its output does not depend
on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout_fleet.engine.protocol import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for a batch of B requests (rebuilt only when the batch changes)."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] long, vocab size where disabled; None when no row filters by top-k
    top_p: torch.Tensor | None  # [B] float32; None when every row has top_p == 1
    min_p: torch.Tensor | None  # [B] float32; None when every row has min_p == 0
    generators: list[torch.Generator | None]  # per-row generator of seeded requests
    any_seeded: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        top_k = top_p = min_p = None
        if any(p.top_k not in (-1,) and p.top_k < vocab_size for p in sampled):
            top_k = torch.tensor(
                [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params], device=device
            )
        if any(p.top_p < 1.0 for p in sampled):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in sampled):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=list(generators),
            any_seeded=any(g is not None for g in generators),
        )


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator private to one request, so ``sampling_seed`` reproduces its output in any batch."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def _uniforms(
    batch: SamplingBatch, size: int, default: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One U[0, 1) per row: seeded rows from their own generator, the others from the engine's."""
    shared = torch.rand(size, generator=default, device=device)
    if not batch.any_seeded:
        return shared
    own = [torch.rand(1, generator=g, device=device) if g is not None else None for g in batch.generators]
    return torch.cat([o if o is not None else shared[i : i + 1] for i, o in enumerate(own)])


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from unnormalised non-negative ``weights`` [B, V] with uniforms ``u`` [B]."""
    cdf = weights.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    # First index whose cumulative weight exceeds the target: never a zero-weight entry.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)


def filter_sorted(
    probs_sorted: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """SGLang's top-k, then top-p, then min-p on probabilities sorted descending ([B, V] -> [B, V]).

    top-p keeps a token when the mass strictly before it is <= top_p, so the most likely token always stays.
    """
    out = probs_sorted
    if top_k is not None:
        ranks = torch.arange(out.shape[-1], device=out.device).unsqueeze(0)
        out = out.masked_fill(ranks >= top_k.unsqueeze(1), 0.0)
    if top_p is not None:
        before = probs_sorted.cumsum(-1) - probs_sorted
        out = out.masked_fill(before > top_p.unsqueeze(1), 0.0)
    if min_p is not None:
        threshold = probs_sorted[:, :1] * min_p.unsqueeze(1)
        out = out.masked_fill(probs_sorted < threshold, 0.0)
    return out


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    default_generator: torch.Generator,
    banned: Sequence[tuple[int, Sequence[int]]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V] (float32); returns (token ids [B], log-probs [B]).

    ``banned`` lists (row, token ids) whose logits are -inf for this step (``min_new_tokens`` blocks stop
    tokens that way, as SGLang's penaliser does).
    """
    if banned:
        logits = logits.clone()
        for row, ids in banned:
            logits[row, list(ids)] = float("-inf")
    logprobs = torch.log_softmax(logits / batch.temperature.unsqueeze(1), dim=-1)
    best = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = best
    else:
        u = _uniforms(batch, logits.shape[0], default_generator, logits.device)
        probs = logprobs.exp()
        if batch.top_k is None and batch.top_p is None and batch.min_p is None:
            drawn = _inverse_cdf(probs, u)
        else:
            probs_sorted, order = probs.sort(dim=-1, descending=True)
            kept = filter_sorted(probs_sorted, batch.top_k, batch.top_p, batch.min_p)
            drawn = order.gather(1, _inverse_cdf(kept, u).unsqueeze(1)).squeeze(1)
        tokens = torch.where(batch.greedy, best, drawn)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
