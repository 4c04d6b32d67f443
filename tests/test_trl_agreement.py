"""Agreement with TRL: TRL 1.16's GRPOTrainer and streamrl, fed the same tensors, compute the same advantages,
loss values and gradients, except where docs/losses.md ("Agreement with TRL") says exactly how they differ;
those differences are asserted here as formulas, not skipped.

TRL's side is a real ``trl.GRPOTrainer`` on the repo's tiny Qwen2. Its advantages come from
``_generate_and_score_completions`` (real generation, scored by a reward function that returns rewards this
test chose), its loss and gradient from ``_compute_loss``. streamrl's side is the learner's own path:
``learner.advantages`` on the same rewards in the same groups, and ``packing.collate`` ->
``step.sample_logprobs`` (packed forward, chunked lm-head loss) -> ``compute_policy_loss`` with the arguments
``learner/step.py`` passes
(``logp_proximal = sg(logp_new)``), on a model with the same weights. The old log-probs are shifted away from
the current ones so that every clip region is populated (checked), which makes a wrong epsilon, a wrong std or
a wrong aggregation show up as a difference far above the tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from learner.advantages import compute_advantages
from learner.attention import register_packed_attention
from learner.config import AdvantageConfig, LossConfig
from learner.losses import compute_policy_loss
from learner.packing import TrainSequence, collate
from learner.step import sample_logprobs
from rollout_fleet.model import init_tiny_model

PROMPTS = ["1+2=", "3+4=", "5+6="]
GROUP = 8
MAX_LEN = 8  # TRL's max_completion_length; also Dr. GRPO's constant divisor
# One reward list per prompt group. The last group is flat: all its rewards are equal, so it carries no signal.
REWARDS = [
    [0.0, 1.0, 0.5, 0.25, 1.0, 0.0, 0.75, 0.3],
    [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
    [0.1] * GROUP,
]
TRL_STD_EPS = 1e-4  # hard-coded in TRL: advantages / (std + 1e-4)

# Measured maxima (float32 throughout): advantages 1.2e-7, loss 6e-8, gradient 3e-7 (largest entry ~0.6).
ADV_TOL = 1e-6
LOSS_TOL = 1e-6
GRAD_TOL = 2e-6


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("trl_agreement") / "tiny")


def make_trainer(model_dir: Path, out_dir: Path, rewards: list[float] | None = None, **overrides: Any):
    """A real GRPOTrainer on the tiny model; ``rewards`` is what its reward function returns for every batch."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    fixed = [0.0] * (len(PROMPTS) * GROUP) if rewards is None else list(rewards)

    def fixed_reward(completions: list, **kwargs: Any) -> list[float]:
        # Ignore the completions: the advantages then depend only on rewards the test chose.
        return list(fixed)

    settings: dict[str, Any] = dict(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=len(PROMPTS) * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_LEN,
        beta=0.0,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    settings.update(overrides)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=fixed_reward,
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    # What Trainer.train() sets up before each compute_loss with gradient_accumulation_steps = 1: train mode
    # (TRL's "train" branches) and the accumulation count that its grpo/bnpo/dr_grpo losses divide by.
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


# --------------------------------------------------------------------------------------------- advantages


@pytest.fixture(scope="module")
def trl_advantages(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tensor]:
    """TRL's advantages ``[G, N]`` for REWARDS, per ``scale_rewards`` setting."""
    out: dict[str, Tensor] = {}
    flat_rewards = [r for group in REWARDS for r in group]
    inputs = [
        {"prompt": p} for p in PROMPTS for _ in range(GROUP)
    ]  # groups are consecutive, as TRL makes them
    for scale in ("group", "none"):
        trainer = make_trainer(model_dir, tmp_path_factory.mktemp(scale), flat_rewards, scale_rewards=scale)
        scored = trainer._generate_and_score_completions(inputs)
        assert scored["completion_ids"].shape[0] == len(inputs)
        out[scale] = scored["advantages"].detach().view(len(REWARDS), GROUP)
    return out


def _rewards() -> Tensor:
    return torch.tensor(REWARDS, dtype=torch.float32)


SIGNAL = slice(0, 2)  # the groups with unequal rewards
FLAT = 2


def test_group_scaled_advantages_agree_with_trl_at_trl_eps(trl_advantages: dict[str, Tensor]) -> None:
    ours = compute_advantages(_rewards(), AdvantageConfig(estimator="grpo", eps=TRL_STD_EPS))
    diff = (ours[SIGNAL] - trl_advantages["group"][SIGNAL]).abs().max().item()
    assert diff <= ADV_TOL, f"GRPO advantages differ from TRL scale_rewards='group' by {diff}"


def test_trl_std_eps_differs_from_our_default_by_exactly_the_eps(trl_advantages: dict[str, Tensor]) -> None:
    """TRL divides by std + 1e-4 (fixed); our default eps is 1e-6. Both use the unbiased (N - 1) std."""
    config = AdvantageConfig()
    assert config.estimator == "grpo" and config.std_normalise and config.eps == 1e-6
    ours = compute_advantages(_rewards(), config)[SIGNAL]
    trl = trl_advantages["group"][SIGNAL]
    assert (ours - trl).abs().max().item() > 100 * ADV_TOL  # a real difference at these rewards
    std = _rewards()[SIGNAL].std(dim=1, unbiased=True, keepdim=True)
    rescaled = ours * (std + config.eps) / (std + TRL_STD_EPS)
    diff = (rescaled - trl).abs().max().item()
    assert diff <= ADV_TOL, f"TRL != ours * (std + 1e-6) / (std + 1e-4): off by {diff}"


def test_flat_group_is_exactly_zero_here_and_rounding_residue_in_trl(
    trl_advantages: dict[str, Tensor],
) -> None:
    """Eight equal rewards of 0.1: float32's group mean is off in the last bit, so TRL returns
    residue / (residue-sized std + 1e-4), about -7e-5 per sample; we force exact zeros."""
    ours = compute_advantages(_rewards(), AdvantageConfig(eps=TRL_STD_EPS))[FLAT]
    assert torch.equal(ours, torch.zeros(GROUP))
    trl = trl_advantages["group"][FLAT]
    assert (trl != 0).all() and trl.abs().max().item() < 1e-3, trl


def test_unscaled_advantages_agree_with_trl(trl_advantages: dict[str, Tensor]) -> None:
    """TRL scale_rewards='none' is r - mean(r): our grpo with std_normalise=false, and our dr_grpo."""
    trl = trl_advantages["none"]
    for config in (AdvantageConfig(std_normalise=False), AdvantageConfig(estimator="dr_grpo")):
        ours = compute_advantages(_rewards(), config)
        diff = (ours[SIGNAL] - trl[SIGNAL]).abs().max().item()
        assert diff <= ADV_TOL, f"{config.estimator} (std_normalise={config.std_normalise}) off by {diff}"
        # The flat group: exact zeros here, the mean's last-bit residue (~7e-9) in TRL.
        assert torch.equal(ours[FLAT], torch.zeros(GROUP))
        assert trl[FLAT].abs().max().item() < 1e-6


# ---------------------------------------------------------------------------------------------------- loss


@dataclass
class LossBatch:
    """One batch of B sequences: equal-length prompts (TRL left-pads prompts, collate right-pads whole
    sequences; equal lengths give both the same positions) and right-padded completions of ``lengths``."""

    prompt_ids: Tensor  # long [B, P]
    completion_ids: Tensor  # long [B, C]
    lengths: Tensor  # long [B]; completion tokens of each row (0: an all-masked row)
    advantages: Tensor  # float [B]
    delta: Tensor  # float [B, C]; old logp = current logp + delta, so log-ratio = -delta
    ref_delta: Tensor  # float [B, C]; ref logp = current logp + ref_delta

    @property
    def completion_mask(self) -> Tensor:
        return (torch.arange(self.completion_ids.shape[1])[None] < self.lengths[:, None]).long()


def make_batch(model_dir: Path, lengths: list[int]) -> LossBatch:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    b = len(lengths)
    prompts = [PROMPTS[i % 2] for i in range(b)]
    prompt_ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, tokenizer.vocab_size, (b, MAX_LEN), generator=g)
    # Row offsets put whole sequences on both sides of the clip range (and two inside GSPO's tiny one);
    # the per-token noise spreads tokens over every token-level region.
    offset = torch.tensor([0.3, -0.3, 1e-4, -1e-4, -0.25, 0.25, -0.2, -1.3])
    noise = torch.randn(b, MAX_LEN, generator=g)
    return LossBatch(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        lengths=torch.tensor(lengths),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.7, 1.2, -0.3, 0.8, -1.5]),
        delta=offset[:, None] + 0.4 * (noise - noise.mean(dim=1, keepdim=True)),
        ref_delta=0.3 * torch.randn(b, MAX_LEN, generator=g),
    )


# Ragged rows exercise the masks; rows 2 and 3 are full, so their row-mean log-ratio is exactly the offset
# (inside GSPO's clip range); with this seed every token-level region of the checks below is populated.
LENGTHS = [8, 8, 8, 8, 3, 8, 6, 5]


@dataclass
class Side:
    loss: Tensor
    grads: dict[str, Tensor]
    logp: Tensor  # [B, C] current per-token log-probs of the completion tokens (0 off the mask)


def _grads(model: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@dataclass
class Given:
    """The data both sides are given, ``[B, C]``: old (behaviour) and reference log-probs."""

    old: Tensor
    ref: Tensor


def trl_side(trainer: GRPOTrainer, batch: LossBatch, num_items: int | None = None) -> tuple[Side, Given]:
    """TRL's ``_compute_loss`` and its gradient; also returns the old and reference log-probs it was given."""
    model = trainer.model
    mask = batch.completion_mask
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([torch.ones_like(batch.prompt_ids), mask], dim=1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, MAX_LEN)
    given = Given(old=current + batch.delta, ref=current + batch.ref_delta)
    inputs = {
        "prompt_ids": batch.prompt_ids,
        "prompt_mask": torch.ones_like(batch.prompt_ids),
        "completion_ids": batch.completion_ids,
        "completion_mask": mask,
        "advantages": batch.advantages,
        "old_per_token_logps": given.old,
        "ref_per_token_logps": given.ref,
        "num_items_in_batch": torch.tensor(int(mask.sum()) if num_items is None else num_items),
    }
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return Side(loss.detach(), _grads(model), current * mask), given


def our_side(
    model: torch.nn.Module,
    batch: LossBatch,
    given: Given,
    config: LossConfig,
    normaliser: float | None = None,
    temperature: float = 1.0,
    extra: Any = None,
) -> Side:
    """streamrl's loss on the same sequences through collate -> sample_logprobs, as learner/step.py calls it
    (the model's attention switched to the packed one for the call, and back); ``extra(logp [B, C], mask [B, C])`` adds a term before backward (to state a difference exactly)."""
    seqs = []
    for i, n in enumerate(batch.lengths.tolist()):
        seqs.append(
            TrainSequence(
                prompt_ids=batch.prompt_ids[i],
                output_ids=batch.completion_ids[i, :n],
                logprobs=given.old[i, :n],
                versions=torch.zeros(n),
                loss_mask=torch.ones(n),
                advantages=float(batch.advantages[i]),
                index=i,
            )
        )
    mb = collate(seqs, pad_id=0)
    p = batch.prompt_ids.shape[1]
    assert mb.input_ids.shape == (len(seqs), p + MAX_LEN)  # completion t of row i sits at column p + t
    model.zero_grad(set_to_none=True)
    previous = model.config._attn_implementation
    model.set_attn_implementation(register_packed_attention())
    try:
        logp, _ = sample_logprobs(model, mb, torch.full((len(seqs),), temperature), chunk_tokens=5)
    finally:
        model.set_attn_implementation(previous)
    ref = torch.cat([torch.zeros_like(batch.prompt_ids, dtype=logp.dtype), given.ref], dim=1)
    loss, _ = compute_policy_loss(
        logp,
        mb.logp_behaviour,
        logp.detach(),
        mb.advantages,
        mb.loss_mask,
        config,
        logp_ref=ref,
        normaliser=normaliser,
    )
    if extra is not None:
        loss = loss + extra(logp[:, p:], batch.completion_mask)
    loss.backward()
    return Side(loss.detach(), _grads(model), logp[:, p:].detach() * batch.completion_mask)


def assert_same(trl: Side, ours: Side) -> None:
    loss_diff = abs(trl.loss.item() - ours.loss.item())
    assert loss_diff <= LOSS_TOL, f"loss: TRL {trl.loss.item()} vs streamrl {ours.loss.item()}"
    assert_same_gradient(trl, ours)


def assert_same_gradient(trl: Side, ours: Side) -> None:
    logp_diff = (trl.logp - ours.logp).abs().max().item()
    assert logp_diff <= LOSS_TOL, f"per-token log-probs differ by {logp_diff}"
    assert trl.grads.keys() == ours.grads.keys()
    grad_diff = max((trl.grads[n] - ours.grads[n]).abs().max().item() for n in trl.grads)
    grad_max = max(g.abs().max().item() for g in trl.grads.values())
    assert grad_max > 1e-2  # a real gradient, not two zeros
    assert grad_diff <= GRAD_TOL, f"gradients differ by {grad_diff} (largest entry {grad_max})"


def assert_token_clipping_exercised(batch: LossBatch, logp: Tensor, given: Given, config: LossConfig) -> None:
    """Every token-level region is populated, so a wrong clip bound changes the loss or the gradient."""
    ratio = torch.exp(logp - given.old)
    adv = batch.advantages[:, None].expand_as(ratio)
    valid = batch.completion_mask.bool()
    hi, lo = 1 + config.eps_high, 1 - config.eps_low
    regions = {
        "A>0 clipped above": (adv > 0) & (ratio > hi),
        "A<0 clipped below": (adv < 0) & (ratio < lo),
        "A>0 inside": (adv > 0) & (ratio <= hi) & (ratio >= lo),
        "A<0 inside": (adv < 0) & (ratio <= hi) & (ratio >= lo),
        "A>0 below the range (not clipped)": (adv > 0) & (ratio < lo),
        "A<0 above the range (not clipped)": (adv < 0) & (ratio > hi),
    }
    if config.eps_high != config.eps_low:  # clip-higher: tokens that only the asymmetric bounds treat right
        regions["A>0 in (1 + eps_low, 1 + eps_high]"] = (
            (adv > 0) & (ratio > 1 + config.eps_low) & (ratio <= hi)
        )
        regions["A<0 in [1 - eps_high, 1 - eps_low)"] = (
            (adv < 0) & (ratio < lo) & (ratio >= 1 - config.eps_high)
        )
    if config.dual_clip is not None:
        regions["A<0 beyond the dual clip"] = (adv < 0) & (ratio > config.dual_clip)
    empty = [name for name, region in regions.items() if not (region & valid).any()]
    assert not empty, f"no token in {empty}"


@dataclass
class Mapping:
    """A TRL setting and the streamrl LossConfig that computes the same loss."""

    trl: dict[str, Any]
    ours: dict[str, Any]
    temperature: float = 1.0
    global_normaliser: bool = False  # dapo: num_items_in_batch spans the generation batch


# TRL: epsilon = 0.2, epsilon_high = epsilon, and no dual clip (ours is on by default)
PPO = dict(policy_loss="ppo", eps_low=0.2, eps_high=0.2, dual_clip=None)
AGREEING = {
    "bnpo~token-mean": Mapping(dict(loss_type="bnpo"), dict(PPO, aggregation="token-mean")),
    "dapo~token-mean/global-normaliser/clip-higher": Mapping(
        dict(loss_type="dapo", epsilon_high=0.28),
        dict(PPO, aggregation="token-mean", eps_high=0.28),
        global_normaliser=True,
    ),
    "grpo~seq-mean": Mapping(dict(loss_type="grpo"), dict(PPO, aggregation="seq-mean")),
    "dr_grpo~seq-mean-token-sum": Mapping(
        dict(loss_type="dr_grpo"), dict(PPO, aggregation="seq-mean-token-sum", norm_length=MAX_LEN)
    ),
    "dapo+delta~dual_clip": Mapping(
        dict(loss_type="dapo", delta=3.0), dict(PPO, aggregation="token-mean", dual_clip=3.0)
    ),
    # old = current + delta keeps the ratios (so the value) fixed; the log-probs and the gradient carry T.
    "bnpo+temperature": Mapping(
        dict(loss_type="bnpo", temperature=0.7), dict(PPO, aggregation="token-mean"), temperature=0.7
    ),
    "bnpo+kl(no bias correction)~kl_coef": Mapping(
        dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=False),
        dict(PPO, aggregation="token-mean", kl_coef=0.04),
    ),
}


@pytest.mark.parametrize("name", list(AGREEING))
def test_clipped_loss_and_gradient_agree_with_trl(model_dir: Path, tmp_path: Path, name: str) -> None:
    m = AGREEING[name]
    trainer = make_trainer(model_dir, tmp_path, **m.trl)
    batch = make_batch(model_dir, LENGTHS)
    tokens = int(batch.completion_mask.sum())
    num_items = 3 * tokens if m.global_normaliser else None  # as if this were one third of the step
    trl, given = trl_side(trainer, batch, num_items)
    config = LossConfig(**m.ours)
    ours = our_side(trainer.model, batch, given, config, normaliser=num_items, temperature=m.temperature)
    assert_token_clipping_exercised(batch, trl.logp, given, config)
    assert_same(trl, ours)


def test_trl_sequence_level_grpo_is_our_gspo(model_dir: Path, tmp_path: Path) -> None:
    """TRL importance_sampling_level='sequence' with loss_type='grpo' is GSPO: our gspo with seq-mean."""
    eps_low, eps_high = 3e-4, 4e-4
    trainer = make_trainer(
        model_dir,
        tmp_path,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=eps_low,
        epsilon_high=eps_high,
    )
    batch = make_batch(model_dir, LENGTHS)
    trl, given = trl_side(trainer, batch)
    config = LossConfig(  # TRL caps neither the sequence log-ratio nor a negative advantage's loss
        policy_loss="gspo", aggregation="seq-mean", gspo_eps_low=eps_low, gspo_eps_high=eps_high,
        dual_clip=None, gspo_log_ratio_cap=20.0,
    )  # fmt: skip
    ours = our_side(trainer.model, batch, given, config)
    mask = batch.completion_mask
    seq_ratio = torch.exp(((trl.logp - given.old) * mask).sum(1) / mask.sum(1))
    inside = (seq_ratio >= 1 - eps_low) & (seq_ratio <= 1 + eps_high)
    clipped = ((batch.advantages > 0) & (seq_ratio > 1 + eps_high)) | (
        (batch.advantages < 0) & (seq_ratio < 1 - eps_low)
    )
    assert inside.any() and clipped.any() and not (inside | clipped).all()
    assert_same(trl, ours)


# ------------------------------------------------------------------------------ documented differences


def test_trl_cispo_has_our_tis_gradient_but_a_different_value(model_dir: Path, tmp_path: Path) -> None:
    """TRL cispo: -sg(min(r, eps_high)) A log pi. Our tis without a proximal policy: -sg(min(r, C)) A r' with
    r' = pi / sg(pi) = 1 in value. Same gradient, sg(w) A grad log pi; the values differ by the log pi factor."""
    cap = 1.5
    trainer = make_trainer(model_dir, tmp_path, loss_type="cispo", epsilon_high=cap)
    batch = make_batch(model_dir, LENGTHS)
    trl, given = trl_side(trainer, batch)
    config = LossConfig(policy_loss="tis", aggregation="token-mean", tis_cap=cap)
    ours = our_side(trainer.model, batch, given, config)
    mask = batch.completion_mask
    raw = torch.exp(trl.logp - given.old)
    assert ((raw > cap) & mask.bool()).any() and ((raw < cap) & mask.bool()).any()
    w, adv, n = raw.clamp(max=cap), batch.advantages[:, None], mask.sum()
    assert abs(trl.loss.item() - (-(w * adv * trl.logp * mask).sum() / n).item()) <= LOSS_TOL
    assert abs(ours.loss.item() - (-(w * adv * mask).sum() / n).item()) <= LOSS_TOL
    assert abs(trl.loss.item() - ours.loss.item()) > 0.1
    assert_same_gradient(trl, ours)


def test_trl_default_kl_bias_correction_is_ratio_weighted(model_dir: Path, tmp_path: Path) -> None:
    """TRL's default use_bias_correction_kl=True multiplies each token's k3 KL by the (differentiable) ratio
    r = pi / pi_old; we add the plain k3. So TRL = ours + beta * token-mean(k3 * (r - 1)), value and gradient."""
    beta = 0.04
    trainer = make_trainer(model_dir, tmp_path, loss_type="bnpo", beta=beta)
    assert trainer.args.use_bias_correction_kl  # TRL's default
    batch = make_batch(model_dir, LENGTHS)
    trl, given = trl_side(trainer, batch)

    def ratio_weighting(logp: Tensor, mask: Tensor) -> Tensor:
        k3 = torch.exp(given.ref - logp) - (given.ref - logp) - 1
        return beta * (k3 * (torch.exp(logp - given.old) - 1) * mask).sum() / mask.sum()

    config = LossConfig(**PPO, aggregation="token-mean", kl_coef=beta)
    plain = our_side(trainer.model, batch, given, config)
    assert abs(trl.loss.item() - plain.loss.item()) > 1e-4  # the weighting matters at these ratios
    assert_same(trl, our_side(trainer.model, batch, given, config, extra=ratio_weighting))


@pytest.mark.parametrize(
    "loss_type,ours",
    [
        ("grpo", dict(PPO, aggregation="seq-mean")),
        ("dr_grpo", dict(PPO, aggregation="seq-mean-token-sum", norm_length=MAX_LEN)),
    ],
)
def test_trl_counts_all_masked_rows_in_the_sequence_mean(
    model_dir: Path, tmp_path: Path, loss_type: str, ours: dict[str, Any]
) -> None:
    """A row without loss tokens (TRL's mask_truncated_completions, our mask_truncated) still counts in TRL's
    grpo / dr_grpo denominator (B rows); ours counts non-empty sequences. normaliser = B reproduces TRL."""
    lengths = list(LENGTHS)
    lengths[3] = 0
    trainer = make_trainer(model_dir, tmp_path, loss_type=loss_type)
    batch = make_batch(model_dir, lengths)
    trl, given = trl_side(trainer, batch)
    config = LossConfig(**ours)
    rows = len(lengths)
    default = our_side(trainer.model, batch, given, config)
    expected = default.loss.item() * (rows - 1) / rows
    assert abs(trl.loss.item() - expected) <= LOSS_TOL, (trl.loss.item(), default.loss.item())
    assert abs(trl.loss.item() - default.loss.item()) > 1e-3
    assert_same(trl, our_side(trainer.model, batch, given, config, normaliser=rows))
