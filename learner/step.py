"""A learner step on one rank: a batch of groups, split into minibatches, each one optimizer update (forward /
backward over this rank's micro-batches of it, then clip and step), the whole repeated for ``ppo_epochs``.

The trust region: with more than one update per step, every update's ratio is taken against the proximal
policy, the weights before the step's first update. Its log-probs are computed once, by a forward without
gradient over every micro-batch before the first update (AReaL's recompute), so the second and later updates
clip against where the step started and decoupled PPO corrects pi_prox / mu. With one update per step the
proximal log-probs are the current ones, detached: the same values, without the extra forward. The frozen
reference model's log-probs (``loss.kl_coef > 0``) come from the same pass.

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

from learner.advantages import step_advantages
from learner.attention import PACKED_ATTENTION, PACKED_IMPLEMENTATIONS
from learner.config import LearnerConfig
from learner.logprobs import token_logprobs
from learner.losses import compute_policy_loss, entropy_bonus, kl_penalty
from learner.packing import MicroBatch


@dataclass
class StepResult:
    applied: bool  # False: a non-finite loss or gradient skipped every optimizer update of the step
    grad_norm: float
    metrics: dict[str, float]


@dataclass
class UpdateInputs:
    """One optimizer update of a step on one rank: this rank's micro-batches of one minibatch."""

    micro_batches: list[MicroBatch]
    temperatures: list[Tensor]  # per micro-batch: float [b], each row's sampling temperature
    normaliser: float  # the minibatch's global loss normaliser (every rank, every micro-batch)
    trained: bool = True  # False: no rank has a sequence that carries gradient; the update is not taken

    def to(self, device: torch.device | str) -> UpdateInputs:
        return UpdateInputs(
            [mb.to(device) for mb in self.micro_batches],
            [t.to(device) for t in self.temperatures],
            self.normaliser,
            self.trained,
        )


@dataclass
class FixedLogprobs:
    """Log-probs of one micro-batch's trained tokens from before the step's first update, ``[b, L]`` each."""

    proximal: Tensor | None  # the policy's own (None: one update per step, the current ones stand in)
    reference: Tensor | None  # the frozen reference model's (None: no reference KL)


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
    if implementation not in PACKED_IMPLEMENTATIONS:
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
        packed_varlen=rows.varlen,
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


@dataclass
class RewardPenalty:
    """``loss.kl_mode = reward``: what every rank needs to recompute the step's advantages once the reference
    KL of each sample is known (sequence indices are ``TrainSequence.index``)."""

    rewards: list[float]  # per sequence index: the sample's reward
    groups: list[list[int]]  # the sequence indices of each group
    tokens: list[float]  # per sequence index: the tokens it trains (the REINFORCE++ whitening's weights)


def penalise_rewards(
    updates: list[UpdateInputs],
    fixed: list[list[FixedLogprobs]],
    penalty: RewardPenalty,
    config: LearnerConfig,
) -> float:
    """Subtract ``kl_coef x`` each sample's summed reference KL (behaviour tokens vs the reference, over its
    loss tokens) from its reward, recompute the advantages, and write them into every
    micro-batch in place (verl's ``use_kl_in_reward`` for outcome rewards; the REINFORCE++ estimators whiten over
    the whole step again). Returns the mean penalty.

    Each sample sits in exactly one micro-batch of one rank, so a sum over ranks gives every rank every KL."""
    n = len(penalty.rewards)
    kl_sum = torch.zeros(n, dtype=torch.float64)
    for update, row in zip(updates, fixed, strict=True):
        for mb, f in zip(update.micro_batches, row, strict=True):
            assert f.reference is not None
            live = mb.seq_index >= 0
            kl = kl_penalty(mb.logp_behaviour, f.reference, config.loss.kl_estimator) * mb.loss_mask
            kl_sum.index_add_(0, mb.seq_index[live].cpu(), kl[live].sum(dim=1).double().cpu())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(kl_sum)
    shaped = torch.tensor(penalty.rewards, dtype=torch.float64) - config.loss.kl_coef * kl_sum
    advantages = torch.zeros(n, dtype=torch.float64)
    tokens = torch.tensor(penalty.tokens, dtype=torch.float64)
    per_group = step_advantages(
        [shaped[m] for m in penalty.groups], [tokens[m] for m in penalty.groups], config.advantage
    )
    for members, group_advantages in zip(penalty.groups, per_group, strict=True):
        advantages[members] = group_advantages
    for update in updates:
        for mb in update.micro_batches:
            rows = advantages[mb.seq_index.clamp(min=0).cpu()].to(mb.advantages)
            rows = torch.where(mb.seq_index.to(rows.device) >= 0, rows, torch.zeros_like(rows))
            mb.advantages = torch.where(mb.versions >= 0, rows[:, None], torch.zeros_like(mb.advantages))
    return float(config.loss.kl_coef * kl_sum.mean()) if n else 0.0


def micro_batch_forward(
    model: nn.Module,
    mb: MicroBatch,
    temperature: Tensor,
    config: LearnerConfig,
    normaliser: float,
    world_size: int,
    learner_version: int,
    sums: MetricSums,
    fixed: FixedLogprobs | None = None,
) -> Tensor:
    """Forward + backward of one micro-batch; returns the (detached) loss contribution.

    ``fixed`` holds the proximal and reference log-probs from before the step's first update; without a
    proximal the current log-probs, detached, are the proximal policy (the first update of a step)."""
    logp, entropy = sample_logprobs(model, mb, temperature, config.loss_chunk_tokens)
    mask = mb.loss_mask
    fixed = fixed or FixedLogprobs(None, None)
    proximal = fixed.proximal if fixed.proximal is not None else logp.detach()
    loss, metrics = compute_policy_loss(
        logp,
        mb.logp_behaviour,
        proximal,
        mb.advantages,
        mask,
        config.loss,
        logp_ref=fixed.reference,
        normaliser=normaliser,
    )
    tokens = float(mask.sum())
    if config.loss.entropy_coef > 0:  # part of the reported `loss`: no metric of its own
        loss = loss + entropy_bonus(entropy, mask, config.loss, normaliser)
    (loss * world_size).backward()
    for name in LOSS_METRIC_MEANS:
        if name in metrics:
            sums.add_mean(name, float(metrics[name]), tokens)
    for name in MAX_KEYS:
        if name in metrics and tokens > 0:
            sums.add_max(name, float(metrics[name]))
    if tokens > 0:
        valid = mask > 0
        sums.add_mean("entropy", float(entropy.detach()[valid].mean()), tokens)
        fresh = valid & (mb.versions == learner_version)
        n_fresh = float(fresh.sum())
        if n_fresh > 0:
            diff = (logp.detach() - mb.logp_behaviour)[fresh]
            sums.add_mean("mismatch_abs", float(diff.abs().mean()), n_fresh)
            sums.add_mean("mismatch_k3", float((torch.exp(-diff) - 1 + diff).mean()), n_fresh)
    return loss.detach()


@torch.no_grad()
def fixed_logprobs(
    model: nn.Module,
    ref_model: nn.Module | None,
    updates: list[UpdateInputs],
    config: LearnerConfig,
) -> list[list[FixedLogprobs]]:
    """The proximal (when the step takes more than one update) and reference (with ``ref_model``) log-probs of
    every micro-batch of every update, from forwards without gradient before the first update.

    Every rank runs the same number of forwards (the plan pads ranks with empty micro-batches), so FSDP2's
    collectives line up."""
    need_prox = config.updates_per_step > 1
    out: list[list[FixedLogprobs]] = []
    for update in updates:
        row = []
        for mb, temp in zip(update.micro_batches, update.temperatures, strict=True):
            prox = sample_logprobs(model, mb, temp, config.loss_chunk_tokens)[0] if need_prox else None
            ref = None
            if ref_model is not None:
                ref = sample_logprobs(ref_model, mb, temp, config.loss_chunk_tokens)[0]
            row.append(FixedLogprobs(prox, ref))
        out.append(row)
    return out


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
    """One update over all of this rank's micro-batches: a step of one minibatch and one epoch."""
    update = UpdateInputs(micro_batches, temperatures, normaliser)
    single = config.model_copy(update={"ppo_minibatches": 1, "ppo_epochs": 1})
    return train_batch(model, optimizer, [update], single, learner_version)


def _update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    update: UpdateInputs,
    fixed: list[FixedLogprobs] | None,
    config: LearnerConfig,
    learner_version: int,
    sums: MetricSums,
) -> tuple[bool, float, float]:
    """One optimizer update; returns (applied, gradient norm, loss summed over ranks)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    loss_total = torch.zeros((), dtype=torch.float64)
    for i, (mb, temp) in enumerate(zip(update.micro_batches, update.temperatures, strict=True)):
        loss_total += micro_batch_forward(
            model, mb, temp, config, update.normaliser, world_size, learner_version, sums,
            fixed[i] if fixed is not None else None,
        ).double()  # fmt: skip
    applied, grad_norm = clip_and_step(model, optimizer, config.max_grad_norm, loss_total)
    if dist.is_initialized() and world_size > 1:
        dist.all_reduce(loss_total)
    return applied, grad_norm, float(loss_total)


def train_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    updates: list[UpdateInputs],
    config: LearnerConfig,
    learner_version: int,
    ref_model: nn.Module | None = None,
    penalty: RewardPenalty | None = None,
) -> StepResult:
    """A learner step: ``config.ppo_epochs`` passes over ``updates`` (one per minibatch, in order), each an
    optimizer update clipped against the proximal policy; see the module docstring.

    Every rank passes the same number of updates, with the same ``trained`` flags. An update that trains
    nothing (every group of its minibatch had equal rewards) is not taken: a zero gradient would still move
    AdamW's weights through its moments. A non-finite loss or gradient skips that update only."""
    if len(updates) != config.ppo_minibatches:
        raise ValueError(f"{len(updates)} updates for learner.ppo_minibatches = {config.ppo_minibatches}")
    sums = MetricSums()
    fixed = None
    if config.updates_per_step > 1 or ref_model is not None:
        fixed = fixed_logprobs(model, ref_model, updates, config)
    kl_reward = None
    if penalty is not None:
        if fixed is None or ref_model is None:
            raise ValueError("loss.kl_mode = 'reward' needs the reference model")
        kl_reward = penalise_rewards(updates, fixed, penalty, config)
    losses, norms, applied, taken = [], [], 0, 0
    for _ in range(config.ppo_epochs):
        for u, update in enumerate(updates):
            if not update.trained:
                continue
            ok, norm, loss = _update(
                model, optimizer, update, fixed[u] if fixed else None, config, learner_version, sums
            )
            taken += 1
            applied += ok
            losses.append(loss)
            if ok:
                norms.append(norm)
    keys = [k for name in MEAN_KEYS + LOSS_METRIC_MEANS for k in (name, name + "#w")]
    metrics = sums.reduce(keys, MAX_KEYS)
    grad_norm = sum(norms) / len(norms) if norms else (math.nan if taken else 0.0)
    metrics["loss"] = sum(losses) / len(losses) if losses else 0.0
    metrics["grad_norm"] = grad_norm
    metrics["updates_taken"] = float(taken)
    metrics["updates_skipped_nonfinite"] = float(taken - applied)
    if kl_reward is not None:
        metrics["kl_reward_penalty"] = kl_reward
    return StepResult(applied=applied > 0 or taken == 0, grad_norm=grad_norm, metrics=metrics)
