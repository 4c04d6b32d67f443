"""One optimizer step on one rank: forward / backward over this rank's micro-batches, then clip and step.

Every rank runs the same number of micro-batches (the plan pads with empty ones), so FSDP2's collectives line
up. The loss of each micro-batch is normalised by the step's GLOBAL unit count and multiplied by the world
size, because FSDP2 averages gradients across ranks: the sum over micro-batches and ranks then equals the
loss of the whole batch computed at once.

The forward never makes ``[tokens, vocab]`` logits: the model runs on the micro-batch's packed rows and
returns its final hidden states, and :func:`learner.logprobs.token_logprobs` computes the trained tokens'
log-probs and entropies chunk by chunk from them and the lm-head's weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from learner.attention import PACKED_ATTENTION
from learner.config import LearnerConfig
from learner.logprobs import token_logprobs
from learner.losses import compute_policy_loss
from learner.packing import MicroBatch


@dataclass
class StepResult:
    applied: bool  # False: a non-finite loss or gradient skipped the optimizer step
    grad_norm: float
    metrics: dict[str, float]


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


# The packed attention reads no mask, so none is built (a packed row's would be [T, T]); one per layer type.
_NO_MASK = {"full_attention": None, "sliding_attention": None}


def forward_hidden(model: nn.Module, mb: MicroBatch) -> Tensor:
    """Final hidden states (after the final norm) ``[r * W, H]`` of the micro-batch's packed rows, flattened.

    The root module is called, not ``model.model``, so FSDP2's root hooks gather the embedding, final norm and
    lm-head; ``logits_to_keep`` selects no position, so the lm-head runs on zero tokens and the hidden states
    come from ``output_hidden_states=-1`` (the normed ``last_hidden_state``, the one entry it keeps). Taking
    them from the root's output rather than from a hook inside it also matters to FSDP2: it registers its root
    pre-backward hook on the root's outputs, and only these carry a gradient (the empty logits do not).
    """
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != PACKED_ATTENTION:
        raise ValueError(
            f"the learner's forward runs on packed rows but the model's attention is {implementation!r}; "
            f"load it with attn_implementation={PACKED_ATTENTION!r}, which "
            "learner.attention.register_packed_attention() registers"
        )
    rows = mb.packed
    out = model(
        input_ids=rows.input_ids,
        position_ids=rows.position_ids,
        attention_mask=_NO_MASK,
        packed_source=rows.source,
        packed_target=rows.target,
        packed_order=rows.order,
        packed_buckets=rows.buckets,
        logits_to_keep=torch.zeros_like(rows.input_ids, dtype=torch.bool),
        output_hidden_states=-1,  # only the last one: the others come back as None
        use_cache=False,
    )
    return out.hidden_states[-1].flatten(0, 1)


def lm_head_parameters(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The output projection's ``weight [V, H]`` and ``bias [V] | None`` as the forward used them.

    Under FSDP2 these are the unsharded parameters, which the root keeps after its forward (it does not
    reshard after forward); their gradient then reaches FSDP2's reduce-scatter like the model's own."""
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    if isinstance(weight, DTensor):
        raise RuntimeError(
            "the lm-head weight is still sharded after the root forward: shard the root with "
            "reshard_after_forward=False (fully_shard's default for the root)"
        )
    return weight, bias


def sample_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: Tensor, chunk_tokens: int
) -> tuple[Tensor, Tensor]:
    """Log-probs ``[b, L]`` (with gradient) and entropies ``[b, L]`` of the trained tokens, 0 elsewhere.

    ``temperature [b]`` is each sample's sampling temperature. Only positions with ``loss_mask`` set are
    computed, each from the hidden state of the position before it in its own sample (``packed.source``).
    """
    hidden = forward_hidden(model, mb)
    rows, cols = (mb.loss_mask > 0).nonzero(as_tuple=True)
    weight, bias = lm_head_parameters(model)
    logp, entropy = token_logprobs(
        hidden[mb.packed.source[rows, cols - 1]],
        weight,
        bias,
        mb.input_ids[rows, cols],
        temperature[rows],
        chunk_tokens,
    )
    zeros = torch.zeros(mb.loss_mask.shape, dtype=torch.float32, device=hidden.device)
    return zeros.index_put((rows, cols), logp), zeros.index_put((rows, cols), entropy)


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
    logp, entropy = sample_logprobs(model, mb, temperature, config.loss_chunk_tokens)
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
        sums.add_mean("entropy", float(entropy[valid].mean()), tokens)
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
