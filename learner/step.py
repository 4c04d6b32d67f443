"""One optimizer step on one rank: forward / backward over this rank's micro-batches, then clip and step.

Every rank runs the same number of micro-batches (the plan pads with empty ones), so FSDP2's collectives line
up. The loss of each micro-batch is normalised by the step's GLOBAL unit count and multiplied by the world
size, because FSDP2 averages gradients across ranks: the sum over micro-batches and ranks then equals the
loss of the whole batch computed at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from learner.attention import SHARED_PROMPT_ATTENTION
from learner.config import LearnerConfig
from learner.losses import compute_policy_loss
from learner.packing import MicroBatch, gather_logprobs


@dataclass
class StepResult:
    applied: bool  # False: a non-finite loss or gradient skipped the optimizer step
    grad_norm: float
    metrics: dict[str, float]


def token_entropy(logits: Tensor, temperature: Tensor) -> Tensor:
    """Entropy ``[b, L]`` of the predictive distribution for token t (from position t - 1); position 0 is 0."""
    with torch.no_grad():
        logp = torch.log_softmax(logits[:, :-1].float() / temperature[:, None, None], dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
    return torch.cat([ent.new_zeros(ent.shape[0], 1), ent], dim=1)


class MetricSums:
    """Token-weighted sums of metrics across micro-batches, reduced across ranks at the end of the step."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxima: dict[str, float] = {}

    def add_mean(self, name: str, mean: float, weight: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + mean * weight
        self.sums[name + "#w"] = self.sums.get(name + "#w", 0.0) + weight

    def add_max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), value)

    def reduce(self, keys: list[str], max_keys: list[str]) -> dict[str, float]:
        """All-reduce over ranks; every rank must pass the same key lists."""
        sums = torch.tensor([self.sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        maxima = torch.tensor([self.maxima.get(k, -math.inf) for k in max_keys], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        out = {}
        for i, k in enumerate(keys):
            if not k.endswith("#w"):
                w = sums[keys.index(k + "#w")].item()
                out[k] = sums[i].item() / w if w > 0 else 0.0
        out.update({k: maxima[i].item() for i, k in enumerate(max_keys)})
        return out


MEAN_KEYS = ["entropy", "mismatch_abs", "mismatch_k3"]
# Names as learner.losses reports them (token-weighted means over the call's valid tokens).
LOSS_METRIC_MEANS = [
    "is_weight_mean", "clip_frac", "is_masked_frac", "is_truncated_frac", "approx_kl", "ratio_mean",
    "logp_mismatch", "kl_ref",
]  # fmt: skip
MAX_KEYS = ["is_weight_max", "ratio_max"]


def forward_logits(model: nn.Module, mb: MicroBatch) -> Tensor:
    """Logits ``[b, L, V]`` in the micro-batch's per-sample layout.

    A micro-batch with shared prompt rows runs the rows (each prompt once) through a model loaded with the
    shared-prompt attention (:mod:`learner.attention`) and gathers the logits back per sample.
    """
    if mb.shared is None:
        return model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
        ).logits
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != SHARED_PROMPT_ATTENTION:
        raise ValueError(
            f"micro-batch has shared prompt rows but the model's attention is {implementation!r}; "
            f"load it with attn_implementation={SHARED_PROMPT_ATTENTION!r} or set learner.share_prompts=false"
        )
    rows = mb.shared
    logits = model(
        input_ids=rows.input_ids,
        position_ids=rows.position_ids,
        prompt_source=rows.source,
        prompt_target=rows.target,
        prompt_buckets=rows.buckets,
    ).logits
    return logits.flatten(0, 1)[rows.source]


def micro_batch_forward(
    model: nn.Module,
    mb: MicroBatch,
    temperature: Tensor,
    config: LearnerConfig,
    normaliser: float,
    world_size: int,
    learner_version: int,
    sums: MetricSums,
) -> Tensor:
    """Forward + backward of one micro-batch; returns the (detached) loss contribution."""
    logits = forward_logits(model, mb)
    logp = gather_logprobs(logits, mb.input_ids, temperature[:, None, None])  # per-row temperature
    mask = mb.loss_mask
    loss, metrics = compute_policy_loss(
        logp, mb.logp_behaviour, logp.detach(), mb.advantages, mask, config.loss, normaliser=normaliser
    )
    (loss * world_size).backward()
    tokens = float(mask.sum())
    for name in LOSS_METRIC_MEANS:
        if name in metrics:
            sums.add_mean(name, float(metrics[name]), tokens)
    for name in MAX_KEYS:
        if name in metrics and tokens > 0:
            sums.add_max(name, float(metrics[name]))
    if tokens > 0:
        valid = mask > 0
        sums.add_mean("entropy", float(token_entropy(logits, temperature)[valid].mean()), tokens)
        fresh = valid & (mb.versions == learner_version)
        n_fresh = float(fresh.sum())
        if n_fresh > 0:
            diff = (logp.detach() - mb.logp_behaviour)[fresh]
            sums.add_mean("mismatch_abs", float(diff.abs().mean()), n_fresh)
            sums.add_mean("mismatch_k3", float((torch.exp(-diff) - 1 + diff).mean()), n_fresh)
    return loss.detach()


def clip_and_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, loss_total: Tensor
) -> tuple[bool, float]:
    """Clip gradients; step only when the loss and the global gradient norm are finite."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    loss_value = loss_total.clone().double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loss_value)
    finite = math.isfinite(norm_value) and math.isfinite(float(loss_value))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return finite, norm_value


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    temperatures: list[Tensor],
    config: LearnerConfig,
    normaliser: float,
    learner_version: int,
) -> StepResult:
    """All of this rank's micro-batches, then one (possibly skipped) optimizer step."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    sums = MetricSums()
    loss_total = torch.zeros((), dtype=torch.float64)
    for mb, temp in zip(micro_batches, temperatures, strict=True):
        loss_total += micro_batch_forward(
            model, mb, temp, config, normaliser, world_size, learner_version, sums
        ).double()
    applied, grad_norm = clip_and_step(model, optimizer, config.max_grad_norm, loss_total)
    keys = [k for name in MEAN_KEYS + LOSS_METRIC_MEANS for k in (name, name + "#w")]
    metrics = sums.reduce(keys, MAX_KEYS)
    loss_sum = loss_total.clone()
    if dist.is_initialized() and world_size > 1:
        dist.all_reduce(loss_sum)
    metrics["loss"] = float(loss_sum)
    metrics["grad_norm"] = grad_norm
    return StepResult(applied=applied, grad_norm=grad_norm, metrics=metrics)
