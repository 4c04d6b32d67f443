"""Off-policy corrected policy losses as pure functions over token tensors.

Every loss in :data:`POLICY_LOSSES` has the same signature::

    fn(logp_new, logp_behaviour, logp_proximal, advantages, mask, config, *, logp_ref=None, normaliser=None)
        -> (loss, metrics)

Shapes (B sequences, T padded token positions):

- ``logp_new [B, T]``: log pi_theta of each token under the policy being trained (carries the gradient).
- ``logp_behaviour [B, T]``: log mu, the log-prob the inference engine sampled the token with.
- ``logp_proximal [B, T] | None``: log pi_prox, the policy before this step (recomputed by the trainer, or
  interpolated); ``None`` means "not available" and each loss says what it uses instead.
- ``advantages [B, T]`` per token, or ``[B]`` per sequence (broadcast over the sequence's tokens).
- ``mask [B, T]`` of 0/1: 1 where a token is trained (output token, loss mask set, not padding).
- ``logp_ref [B, T] | None``: the frozen reference policy, needed when ``config.kl_coef > 0``.
- ``normaliser``: the GLOBAL count of aggregation units (valid tokens for ``token-mean``, valid sequences for
  the ``seq-*`` modes) over every micro-batch and rank of the step; see :func:`loss_units`. With it, the sum of
  the micro-batch losses equals the loss of the whole batch computed at once. ``None`` uses this call's count.

``loss`` is a 0-dim tensor; ``metrics`` maps names to detached 0-dim tensors: means over this call's valid
tokens (weight them by ``metrics["tokens"]`` to combine micro-batches), maxima as maxima.

All inputs except ``logp_new`` are data: they are detached. Positions with ``mask == 0`` are replaced by 0
before any arithmetic, so NaN or inf in padding never reaches the loss or the gradient, and an all-masked batch
returns a loss of exactly 0 with an all-zero (finite) gradient. Every log-ratio is clamped to
``+-config.log_ratio_clamp`` before ``exp``: a token 50 nats stale gives a large but finite weight, which the
caps then bound (prime-rl #2084 broadcast NaN weights after such an overflow). docs/losses.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.config import Aggregation, KlEstimator, LossConfig

LossOutput = tuple[Tensor, dict[str, Tensor]]
PolicyLossFn = Callable[..., LossOutput]


@dataclass(frozen=True)
class _Inputs:
    """Validated, detached (except ``new``) and padding-sanitised inputs, all [B, T]."""

    new: Tensor
    behaviour: Tensor
    proximal: Tensor | None
    ref: Tensor | None
    adv: Tensor
    valid: Tensor  # bool [B, T]


def _prepare(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    logp_ref: Tensor | None,
) -> _Inputs:
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must have shape [B, T], got {tuple(logp_new.shape)}")
    shape = logp_new.shape
    named = {
        "logp_behaviour": logp_behaviour,
        "mask": mask,
        "logp_proximal": logp_proximal,
        "logp_ref": logp_ref,
    }
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} like logp_new")
    if advantages.shape == shape[:1]:
        advantages = advantages[:, None].expand(shape)
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected [B] = {tuple(shape[:1])} "
            f"or [B, T] = {tuple(shape)}"
        )
    valid = mask.bool()

    def clean(x: Tensor | None, detach: bool = True) -> Tensor | None:
        if x is None:
            return None
        x = x.detach() if detach else x
        return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))

    return _Inputs(
        new=clean(logp_new, detach=False),
        behaviour=clean(logp_behaviour),
        proximal=clean(logp_proximal),
        ref=clean(logp_ref),
        adv=clean(advantages.to(logp_new.dtype)),
        valid=valid,
    )


def _log_ratio(a: Tensor, b: Tensor, config: LossConfig) -> Tensor:
    """``clamp(a - b, -c, c)``: the only way a log-ratio reaches ``exp`` in this module."""
    c = config.log_ratio_clamp
    return (a - b).clamp(-c, c)


def _row_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Masked mean of each row: [B, T] -> [B]; a row without valid tokens gives 0."""
    count = valid.sum(dim=1).clamp(min=1)
    return torch.where(valid, x, torch.zeros_like(x)).sum(dim=1) / count


def _masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, torch.zeros_like(x)).sum() / valid.sum().clamp(min=1)


def _masked_max(x: Tensor, valid: Tensor) -> Tensor:
    flat = torch.where(valid, x, torch.zeros_like(x)).flatten()
    return torch.cat([flat, flat.new_zeros(1)]).max()


def _positive(denominator: Tensor | float | int, like: Tensor) -> Tensor:
    d = torch.as_tensor(denominator, dtype=like.dtype, device=like.device)
    return torch.where(d > 0, d, torch.ones_like(d))


def loss_units(mask: Tensor, aggregation: Aggregation) -> Tensor:
    """The count a global ``normaliser`` sums: valid tokens (token-mean) or non-empty sequences (seq-*).

    Sum it over every micro-batch of every rank of the step (an all-reduce) and pass the total as
    ``normaliser`` to each call. If the data-parallel gradient reduction averages over W ranks (FSDP2's
    default), pass ``total / W`` instead, so that the averaged gradient equals the full-batch gradient.
    """
    valid = mask.bool()
    if aggregation == "token-mean":
        return valid.sum()
    return (valid.sum(dim=1) > 0).sum()


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: Aggregation,
    normaliser: Tensor | float | int | None = None,
    norm_length: int = 1024,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    - ``token-mean``: sum over valid tokens / number of valid tokens (DAPO's token-level mean).
    - ``seq-mean``: each sequence's mean over its valid tokens, then the mean over non-empty sequences.
    - ``seq-mean-token-sum``: each sequence's token SUM / ``norm_length``, then the mean over sequences
      (Dr. GRPO: no per-sequence length normalisation, a constant instead).

    ``normaliser`` replaces the denominator of the outer mean (see :func:`loss_units`); a denominator of 0
    (nothing valid) is treated as 1, so an all-masked batch gives exactly 0.
    """
    valid = mask.bool()
    masked = torch.where(valid, per_token, torch.zeros_like(per_token))
    if aggregation == "token-mean":
        denominator = valid.sum() if normaliser is None else normaliser
        return masked.sum() / _positive(denominator, masked)
    if aggregation == "seq-mean":
        per_seq = masked.sum(dim=1) / valid.sum(dim=1).clamp(min=1)
    elif aggregation == "seq-mean-token-sum":
        per_seq = masked.sum(dim=1) / norm_length
    else:
        raise ValueError(f"aggregation = {aggregation!r} is not token-mean, seq-mean or seq-mean-token-sum")
    denominator = (valid.sum(dim=1) > 0).sum() if normaliser is None else normaliser
    return per_seq.sum() / _positive(denominator, masked)


def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the mask rows ``[B, T]`` of outputs cut at the length limit (``truncated`` bool ``[B]``).

    DAPO's overlong filtering: a truncated output has no final answer, so its reward says little about its
    tokens; excluding it keeps that noise out of the gradient.
    """
    if truncated.shape != mask.shape[:1]:
        raise ValueError(
            f"truncated has shape {tuple(truncated.shape)}, expected [B] = {tuple(mask.shape[:1])}"
        )
    return mask * (~truncated.bool())[:, None].to(mask.dtype)


def _surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None):
    """PPO-clip per token: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, optional dual clip.

    Returns the loss and bool masks of where the clip and the dual clip are active (no gradient there).
    """
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual_active = (adv < 0) & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
    return loss, clip_active, dual_active


def _behaviour_weight(log_w: Tensor, valid: Tensor, config: LossConfig) -> Tensor:
    """Raw importance weight ``exp(log_w)`` per token or, at sequence level, the geometric mean per row."""
    if config.is_level == "sequence":
        log_w = _row_mean(log_w, valid)[:, None].expand_as(log_w)
    return torch.exp(log_w)


def kl_penalty(logp: Tensor, logp_ref: Tensor, estimator: KlEstimator, clamp: float = 20.0) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by (approximately) pi, ``[B, T]`` -> ``[B, T]``.

    With ``d = log pi - log ref`` (clamped to ``+-clamp``), Schulman's estimators:

    - ``k1 = d``: unbiased, can be negative per token; its gradient is ``grad log pi`` (it pushes down every
      token's log-prob in proportion to nothing but the sign of the coefficient), so as a loss it is weak;
    - ``k2 = d^2 / 2``: biased, low variance, always >= 0; gradient ``d * grad log pi``;
    - ``k3 = exp(-d) + d - 1``: unbiased, always >= 0; gradient ``(1 - exp(-d)) * grad log pi``.

    ``logp`` carries the gradient; ``logp_ref`` is data.
    """
    d = (logp - logp_ref.detach()).clamp(-clamp, clamp)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"loss.kl_estimator = {estimator!r} is not k1, k2 or k3")


def entropy_bonus(
    entropy: Tensor, mask: Tensor, config: LossConfig, normaliser: Tensor | float | int | None = None
) -> Tensor:
    """``-entropy_coef * aggregate(entropy)``: added to the loss, it rewards a flatter policy.

    ``entropy [B, T]`` (with gradient) is each trained token's tempered entropy; aggregated like the policy
    loss (same mode, same global ``normaliser``), so micro-batch contributions sum to the batch's.
    """
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy has shape {tuple(entropy.shape)}, expected {tuple(mask.shape)} like mask")
    valid = mask.bool()
    clean = torch.where(valid, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
    return -config.entropy_coef * aggregate(clean, valid, config.aggregation, normaliser, config.norm_length)


def _finish(
    x: _Inputs,
    pg_per_token: Tensor,
    config: LossConfig,
    normaliser: Tensor | float | int | None,
    metrics: dict[str, Tensor],
) -> LossOutput:
    """Add the reference KL (``kl_mode = loss``), aggregate, and attach the metrics every loss reports."""
    per_token = pg_per_token
    kl_ref = torch.zeros((), dtype=x.new.dtype, device=x.new.device)
    if config.kl_coef > 0 and config.kl_mode == "loss":
        if x.ref is None:
            raise ValueError(f"loss.kl_coef = {config.kl_coef} needs logp_ref, which was not given")
        kl_tok = kl_penalty(x.new, x.ref, config.kl_estimator, config.log_ratio_clamp)
        per_token = per_token + config.kl_coef * kl_tok
        kl_ref = _masked_mean(kl_tok.detach(), x.valid)
    elif x.ref is not None:  # reported even when the KL is a reward penalty or off
        kl_ref = _masked_mean(kl_penalty(x.new.detach(), x.ref, config.kl_estimator), x.valid)
    loss = aggregate(per_token, x.valid, config.aggregation, normaliser, config.norm_length)
    pg_loss = aggregate(pg_per_token.detach(), x.valid, config.aggregation, normaliser, config.norm_length)
    lr = _log_ratio(x.new.detach(), x.behaviour, config)
    metrics.update(
        loss=loss.detach(),
        pg_loss=pg_loss,
        kl_ref=kl_ref,
        # k3 estimate of KL(mu || pi_new) from the behaviour samples: (r - 1) - log r with r = pi / mu.
        approx_kl=_masked_mean(torch.exp(lr) - 1.0 - lr, x.valid),
        logp_mismatch=_masked_mean((x.new.detach() - x.behaviour).abs(), x.valid),
        tokens=x.valid.sum().to(x.new.dtype),
    )
    return loss, metrics


def _clip_metrics(ratio: Tensor, clip: Tensor, dual: Tensor, valid: Tensor) -> dict[str, Tensor]:
    ratio = ratio.detach()
    return {
        "ratio_mean": _masked_mean(ratio, valid),
        "ratio_max": _masked_max(ratio, valid),
        "clip_frac": _masked_mean(clip.float(), valid),
        "dual_clip_frac": _masked_mean(dual.float(), valid),
    }


def _weight_metrics(raw: Tensor, used: Tensor, valid: Tensor) -> dict[str, Tensor]:
    raw, used = raw.detach(), used.detach()
    return {
        "is_weight_mean": _masked_mean(raw, valid),
        "is_weight_max": _masked_max(raw, valid),
        "is_masked_frac": _masked_mean(((used == 0) & (raw != 0)).float(), valid),
        "is_truncated_frac": _masked_mean(((used < raw) & (used != 0)).float(), valid),
    }


def _ones_weight(x: _Inputs) -> Tensor:
    return torch.ones_like(x.behaviour)


def _weighted_clip_loss(
    x: _Inputs, old: Tensor, raw_w: Tensor, w: Tensor, config: LossConfig, normaliser
) -> LossOutput:
    """``-sg(w) * min(r A, clip(r) A)`` with ``r = exp(new - old)``: the shape every token-level loss shares."""
    ratio = torch.exp(_log_ratio(x.new, old, config))
    surrogate, clip, dual = _surrogate(ratio, x.adv, config.eps_low, config.eps_high, config.dual_clip)
    per_token = w.detach() * surrogate
    metrics = _clip_metrics(ratio, clip, dual, x.valid) | _weight_metrics(raw_w, w, x.valid)
    return _finish(x, per_token, config, normaliser, metrics)


def ppo_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    logp_ref: Tensor | None = None,
    normaliser: Tensor | float | int | None = None,
) -> LossOutput:
    """Standard PPO-clip against the behaviour policy: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``
    with ``r = pi / mu``.

    ``logp_proximal`` is ignored: a trainer that always passes ``sg(logp_new)`` as the proximal policy would
    otherwise get ``r = 1`` and no off-policy handling at all. PPO against a recomputed old policy plus the
    behaviour weight is :func:`decoupled_ppo_loss`.
    """
    x = _prepare(logp_new, logp_behaviour, None, advantages, mask, logp_ref)
    ones = _ones_weight(x)
    return _weighted_clip_loss(x, x.behaviour, ones, ones, config, normaliser)


def decoupled_ppo_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    logp_ref: Tensor | None = None,
    normaliser: Tensor | float | int | None = None,
) -> LossOutput:
    """AReaL's decoupled PPO: ``-sg(w) * min(r A, clip(r) A)``, ``r = pi / pi_prox``, ``w = pi_prox / mu``.

    ``w`` is per token or per sequence (geometric mean, ``config.is_level``) and bounded by
    ``config.behav_cap``: zeroed above it (``mask``, AReaL's choice) or clamped to it (``truncate``).
    Without ``logp_proximal`` the proximal policy is the behaviour policy: ``w = 1`` and this is PPO-clip with
    ``r = pi / mu``.
    """
    x = _prepare(logp_new, logp_behaviour, logp_proximal, advantages, mask, logp_ref)
    prox = x.proximal if x.proximal is not None else x.behaviour
    raw = _behaviour_weight(_log_ratio(prox, x.behaviour, config), x.valid, config)
    w = raw
    if config.behav_cap is not None:
        if config.behav_cap_mode == "mask":
            w = torch.where(raw <= config.behav_cap, raw, torch.zeros_like(raw))
        else:
            w = raw.clamp(max=config.behav_cap)
    return _weighted_clip_loss(x, prox, raw, w, config, normaliser)


def _old_for_correction(x: _Inputs) -> Tensor:
    # Without a proximal policy, "old" is the current policy with its gradient stopped: r = 1 in value, and
    # the surrogate's gradient is A * grad log pi: a plain policy gradient with the weight on it.
    return x.proximal if x.proximal is not None else x.new.detach()


def tis_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    logp_ref: Tensor | None = None,
    normaliser: Tensor | float | int | None = None,
) -> LossOutput:
    """Truncated importance sampling: ``-sg(w) * min(r A, clip(r) A)``, ``w = min(pi_old / mu, C)``.

    With ``logp_proximal`` as ``pi_old`` this is PPO-clip on ``r = pi / pi_old`` corrected by the truncated
    weight (verl's TIS). Without it ``pi_old = sg(pi)``, so ``r = 1`` and the objective is the policy gradient
    ``-sg(min(pi / mu, C)) * A * log pi`` (in gradient). ``C = config.tis_cap``; the weight is per token or
    the per-sequence geometric mean (``config.is_level``).
    """
    x = _prepare(logp_new, logp_behaviour, logp_proximal, advantages, mask, logp_ref)
    old = _old_for_correction(x)
    raw = _behaviour_weight(_log_ratio(old, x.behaviour, config), x.valid, config)
    return _weighted_clip_loss(x, old, raw, raw.clamp(max=config.tis_cap), config, normaliser)


def icepop_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    logp_ref: Tensor | None = None,
    normaliser: Tensor | float | int | None = None,
) -> LossOutput:
    """Masked IS / IcePop: like :func:`tis_loss`, but ``w = pi_old / mu`` inside ``[icepop_low, icepop_high]``
    and 0 outside (the token, or the whole sequence at sequence level, is rejected instead of down-weighted).
    """
    x = _prepare(logp_new, logp_behaviour, logp_proximal, advantages, mask, logp_ref)
    old = _old_for_correction(x)
    raw = _behaviour_weight(_log_ratio(old, x.behaviour, config), x.valid, config)
    inside = (raw >= config.icepop_low) & (raw <= config.icepop_high)
    w = torch.where(inside, raw, torch.zeros_like(raw))
    return _weighted_clip_loss(x, old, raw, w, config, normaliser)


def gspo_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    logp_ref: Tensor | None = None,
    normaliser: Tensor | float | int | None = None,
) -> LossOutput:
    """GSPO: sequence ratio ``s = exp(mean_t log(pi / mu))``, loss ``-min(s A, clip(s) A)`` per sequence.

    The ratio is to the behaviour policy ``mu`` (``logp_proximal`` is ignored, as in :func:`ppo_loss`), so the
    sequence clip is what bounds stale samples. The sequence log-ratio is capped at ``+-gspo_log_ratio_cap``:
    a sequence that far from ``mu`` is far outside the clip (no gradient either way), and the cap bounds its
    loss value at ``e^cap |A|`` (with the dual clip, at ``min(e^cap, c) |A|``). ``A`` is the sequence's advantage
    (the row mean of per-token advantages). Clipped with ``gspo_eps_low / gspo_eps_high``. Each valid token
    carries its sequence's loss, so ``seq-mean`` aggregation is the GSPO paper's objective and ``token-mean``
    weights sequences by their length.
    """
    x = _prepare(logp_new, logp_behaviour, None, advantages, mask, logp_ref)
    c = config.gspo_log_ratio_cap
    seq_log_ratio = _row_mean(_log_ratio(x.new, x.behaviour, config), x.valid).clamp(-c, c)
    ratio = torch.exp(seq_log_ratio)[:, None]
    adv = _row_mean(x.adv, x.valid)[:, None]
    surrogate, clip, dual = _surrogate(
        ratio, adv, config.gspo_eps_low, config.gspo_eps_high, config.dual_clip
    )
    shape = x.new.shape
    per_token = surrogate.expand(shape)
    ones = _ones_weight(x)
    metrics = _clip_metrics(ratio.expand(shape), clip.expand(shape), dual.expand(shape), x.valid)
    metrics |= _weight_metrics(ones, ones, x.valid)
    return _finish(x, per_token, config, normaliser, metrics)


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_loss,
    "decoupled_ppo": decoupled_ppo_loss,
    "tis": tis_loss,
    "icepop": icepop_loss,
    "gspo": gspo_loss,
}


def compute_policy_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    logp_proximal: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    logp_ref: Tensor | None = None,
    normaliser: Tensor | float | int | None = None,
) -> LossOutput:
    """The loss ``config.policy_loss`` names, with the same arguments as each entry of POLICY_LOSSES."""
    if config.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"loss.policy_loss = {config.policy_loss!r} is not one of {list(POLICY_LOSSES)}")
    fn = POLICY_LOSSES[config.policy_loss]
    return fn(
        logp_new,
        logp_behaviour,
        logp_proximal,
        advantages,
        mask,
        config,
        logp_ref=logp_ref,
        normaliser=normaliser,
    )
