"""Policy losses against values computed by hand (arithmetic in the comments), and their edge cases.

Conventions: eps_low = 0.2 and eps_high = 0.28 (the LossConfig defaults) unless a test says otherwise;
"r" is the policy ratio, "w" the behaviour importance weight, A the advantage. Hand values are written to
7 significant digits; tensors are float64 so the comparison is tight.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.configlib import ConfigError
from learner.config import LossConfig
from learner.losses import (
    POLICY_LOSSES,
    aggregate,
    compute_policy_loss,
    decoupled_ppo_loss,
    gspo_loss,
    icepop_loss,
    loss_units,
    mask_truncated,
    ppo_loss,
    tis_loss,
)
from streamrl.config import load

torch.set_num_threads(1)
F64 = torch.float64
ln = math.log


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def leaf(rows: list[list[float]]) -> torch.Tensor:
    return t(rows).requires_grad_(True)


def close(actual: torch.Tensor | float, expected: float | list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0
    )


# ---------------------------------------------------------------- PPO-clip


def test_ppo_by_hand_with_gradient() -> None:
    # behaviour log mu = ln 0.5 everywhere; new = mu * r with r = [1.1, 1.5, 0.5, 0.9]; A = [+1, +1, -1, -1]
    #   tok0 r=1.1 A=+1: max(-1.1, -clip(1.1)=-1.1)        = -1.1   (not clipped, gradient -A r = -1.1)
    #   tok1 r=1.5 A=+1: max(-1.5, -clip(1.5)=-1.28)       = -1.28  (clipped: no gradient)
    #   tok2 r=0.5 A=-1: max(+0.5, +clip(0.5)=+0.8)        = +0.8   (clipped: no gradient)
    #   tok3 r=0.9 A=-1: max(+0.9, +0.9)                   = +0.9   (gradient -A r = +0.9)
    # token-mean: (-1.1 - 1.28 + 0.8 + 0.9) / 4 = -0.68 / 4 = -0.17
    # d loss / d logp_new = [-1.1, 0, 0, 0.9] / 4 = [-0.275, 0, 0, 0.225]
    mu = t([[ln(0.5)] * 4])
    new = (mu + t([[ln(1.1), ln(1.5), ln(0.5), ln(0.9)]])).detach().requires_grad_(True)
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, m = ppo_loss(new, mu, None, adv, torch.ones(1, 4), LossConfig())
    loss.backward()
    close(loss, -0.17)
    close(new.grad, [[-0.275, 0.0, 0.0, 0.225]])
    close(m["clip_frac"], 0.5)
    close(m["ratio_mean"], 1.0)  # (1.1 + 1.5 + 0.5 + 0.9) / 4
    close(m["ratio_max"], 1.5)
    # approx KL (k3, r - 1 - ln r): 0.0046898 + 0.0945349 + 0.1931472 + 0.0053605 = 0.2977324; / 4
    close(m["approx_kl"], 0.0744331)
    # mismatch: mean |ln r| = (0.0953102 + 0.4054651 + 0.6931472 + 0.1053605) / 4
    close(m["logp_mismatch"], 0.3248208)
    close(m["tokens"], 4.0)


def test_clip_higher_is_asymmetric() -> None:
    # r = [1.25, 0.75], A = [+1, -1]
    #   eps_high 0.28: tok0 1.25 < 1.28, not clipped: -1.25 (gradient -1.25)
    #   eps_low  0.2:  tok1 0.75 < 0.8,  clipped:     +0.8  (no gradient)
    #   mean = (-1.25 + 0.8) / 2 = -0.225; grads [-1.25, 0] / 2
    # symmetric eps 0.2: tok0 clipped to -1.2 as well: mean (-1.2 + 0.8) / 2 = -0.2, no gradient at all
    mu = t([[0.0, 0.0]])
    ratios = t([[ln(1.25), ln(0.75)]])
    adv = t([[1.0, -1.0]])
    for eps_high, expected, grads, clip_frac in [
        (0.28, -0.225, [[-0.625, 0.0]], 0.5),
        (0.2, -0.2, [[0.0, 0.0]], 1.0),
    ]:
        new = (mu + ratios).requires_grad_(True)
        loss, m = ppo_loss(new, mu, None, adv, torch.ones(1, 2), LossConfig(eps_low=0.2, eps_high=eps_high))
        loss.backward()
        close(loss, expected)
        close(new.grad, grads)
        close(m["clip_frac"], clip_frac)


def test_dual_clip_bounds_negative_advantage() -> None:
    # r = 10, A = -1: PPO-clip gives max(+10, +0.8) = 10 with gradient 10; dual clip c = 3 bounds it to 3, no grad
    new = leaf([[ln(10.0)]])
    loss, m = ppo_loss(new, t([[0.0]]), None, t([[-1.0]]), torch.ones(1, 1), LossConfig(dual_clip=3.0))
    loss.backward()
    close(loss, 3.0)
    close(new.grad, [[0.0]])
    close(m["dual_clip_frac"], 1.0)
    assert LossConfig().dual_clip == 3.0  # on by default
    new2 = leaf([[ln(10.0)]])
    loss2, _ = ppo_loss(new2, t([[0.0]]), None, t([[-1.0]]), torch.ones(1, 1), LossConfig(dual_clip=None))
    loss2.backward()
    close(loss2, 10.0)
    close(new2.grad, [[10.0]])


def test_ppo_and_gspo_ratio_is_to_the_behaviour_policy_even_with_a_proximal() -> None:
    # mu = 0, prox = ln 2.2 (= new, as a trainer passing sg(logp_new) gives), new = ln 2.2, A = +1:
    # r = pi / mu = 2.2 is clipped at 1.28 -> loss -1.28 (with r = pi / prox it would be -1.0)
    new, mu, prox = t([[ln(2.2)]]), t([[0.0]]), t([[ln(2.2)]])
    for fn, eps in ((ppo_loss, 0.28), (gspo_loss, 4e-4)):
        loss, m = fn(new, mu, prox, t([[1.0]]), torch.ones(1, 1), LossConfig())
        close(loss, -(1 + eps))
        close(m["clip_frac"], 1.0)


# ---------------------------------------------------------------- decoupled PPO (AReaL)


def _decoupled_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # w = prox / mu = [2, 4, 8]; r = new / prox = [1.1, 1.0, 1.2]; A = +1 per sequence
    mu = t([[ln(0.1)] * 3])
    prox = mu + t([[ln(2.0), ln(4.0), ln(8.0)]])
    new = (prox + t([[ln(1.1), 0.0, ln(1.2)]])).detach().requires_grad_(True)
    return new, mu, prox


def test_decoupled_ppo_token_mask_by_hand() -> None:
    # cap 5, mask mode: w = [2, 4, 0 (8 > 5)]; surrogate -A r = [-1.1, -1.0, -1.2] (none clipped)
    # per token [-2.2, -4.0, 0]; token-mean -6.2 / 3 = -2.0666667
    # gradient -w A r / 3 = [-2.2, -4.0, 0] / 3 = [-0.7333333, -1.3333333, 0]
    new, mu, prox = _decoupled_inputs()
    loss, m = decoupled_ppo_loss(new, mu, prox, t([1.0]), torch.ones(1, 3), LossConfig(behav_cap=5.0))
    loss.backward()
    close(loss, -2.0666667)
    close(new.grad, [[-0.7333333, -1.3333333, 0.0]])
    close(m["is_masked_frac"], 1 / 3)
    close(m["is_weight_mean"], 14 / 3)  # (2 + 4 + 8) / 3
    close(m["is_weight_max"], 8.0)


def test_decoupled_ppo_token_truncate_by_hand() -> None:
    # truncate mode: w = [2, 4, 5]; per token [-2.2, -4.0, -6.0]; mean -12.2 / 3 = -4.0666667
    new, mu, prox = _decoupled_inputs()
    cfg = LossConfig(behav_cap=5.0, behav_cap_mode="truncate")
    loss, m = decoupled_ppo_loss(new, mu, prox, t([1.0]), torch.ones(1, 3), cfg)
    close(loss, -4.0666667)
    close(m["is_truncated_frac"], 1 / 3)
    close(m["is_masked_frac"], 0.0)


def test_decoupled_ppo_sequence_level_by_hand() -> None:
    # geometric mean of w: (2 * 4 * 8)^(1/3) = 64^(1/3) = 4 <= 5, kept for every token
    # per token -4 * [1.1, 1.0, 1.2] = [-4.4, -4.0, -4.8]; mean -13.2 / 3 = -4.4
    new, mu, prox = _decoupled_inputs()
    loss, _ = decoupled_ppo_loss(new, mu, prox, t([1.0]), torch.ones(1, 3), LossConfig(is_level="sequence"))
    close(loss, -4.4)
    # cap 3 < 4: the whole sequence is masked: loss 0, every token counted as masked
    loss3, m3 = decoupled_ppo_loss(
        new, mu, prox, t([1.0]), torch.ones(1, 3), LossConfig(is_level="sequence", behav_cap=3.0)
    )
    close(loss3, 0.0)
    close(m3["is_masked_frac"], 1.0)


def test_decoupled_ppo_without_proximal_is_ppo_on_behaviour() -> None:
    new, mu, _ = _decoupled_inputs()
    adv = t([[1.0, -1.0, 0.5]])
    a, _ = decoupled_ppo_loss(new, mu, None, adv, torch.ones(1, 3), LossConfig())
    b, _ = ppo_loss(new, mu, None, adv, torch.ones(1, 3), LossConfig())
    close(a, b.item())
    # here r = new / mu = [2.2, 4, 9.6] are all clipped for A > 0 and unclipped for A < 0, where the default
    # dual clip c = 3 bounds -A r = 4 to 3: [-1.28, +3.0, -0.64] / 3 = 1.08 / 3 = 0.36
    close(a, 0.36)
    c, _ = decoupled_ppo_loss(new, mu, None, adv, torch.ones(1, 3), LossConfig(dual_clip=None))
    close(c, 2.08 / 3)  # without it: [-1.28, +4.0, -0.64] / 3


# ---------------------------------------------------------------- TIS


def test_tis_policy_gradient_by_hand() -> None:
    # no proximal: old = sg(new), r = 1 (value), gradient of -w A log pi; w = min(pi / mu, 2)
    # pi / mu = [0.5, 1.5, 3.0] -> w = [0.5, 1.5, 2.0]; A = [+1, -1, +1]
    # per token -w A = [-0.5, +1.5, -2.0]; mean -1.0 / 3 = -0.3333333
    # gradient -w A / 3 = [-0.1666667, 0.5, -0.6666667]
    mu = t([[ln(0.2)] * 3])
    new = (mu + t([[ln(0.5), ln(1.5), ln(3.0)]])).detach().requires_grad_(True)
    adv = t([[1.0, -1.0, 1.0]])
    loss, m = tis_loss(new, mu, None, adv, torch.ones(1, 3), LossConfig(tis_cap=2.0))
    loss.backward()
    close(loss, -0.3333333)
    close(new.grad, [[-0.1666667, 0.5, -0.6666667]])
    close(m["is_truncated_frac"], 1 / 3)
    close(m["is_weight_mean"], 5 / 3)  # (0.5 + 1.5 + 3) / 3
    close(m["is_weight_max"], 3.0)
    close(m["ratio_mean"], 1.0)


def test_tis_sequence_level_by_hand() -> None:
    # geometric mean (0.5 * 1.5 * 3)^(1/3) = 2.25^(1/3) = 1.3103707 < 2 for every token
    # per token -1.3103707 * [1, -1, 1]; sum -1.3103707; mean -0.4367902
    mu = t([[ln(0.2)] * 3])
    new = mu + t([[ln(0.5), ln(1.5), ln(3.0)]])
    loss, _ = tis_loss(
        new, mu, None, t([[1.0, -1.0, 1.0]]), torch.ones(1, 3), LossConfig(is_level="sequence")
    )
    close(loss, -0.4367902)


def test_tis_on_ppo_with_proximal_by_hand() -> None:
    # prox / mu = [3, 1] -> w = [2 (capped), 1]; r = new / prox = [1.5, 1.0]; A = +1
    # surrogate [-1.28 (clipped), -1.0]; per token [-2.56, -1.0]; mean -1.78
    mu = t([[ln(0.1), ln(0.1)]])
    prox = mu + t([[ln(3.0), 0.0]])
    new = prox + t([[ln(1.5), 0.0]])
    loss, m = tis_loss(new, mu, prox, t([1.0]), torch.ones(1, 2), LossConfig())
    close(loss, -1.78)
    close(m["clip_frac"], 0.5)


# ---------------------------------------------------------------- IcePop / masked IS


def test_icepop_token_level_by_hand() -> None:
    # pi / mu = [0.4, 1.0, 4.0, 6.0], band [0.5, 5]: w = [0, 1, 4, 0]; A = +1
    # per token [0, -1, -4, 0]; mean -5 / 4 = -1.25; gradient [0, -1, -4, 0] / 4
    mu = t([[ln(0.1)] * 4])
    new = (mu + t([[ln(0.4), 0.0, ln(4.0), ln(6.0)]])).detach().requires_grad_(True)
    loss, m = icepop_loss(
        new, mu, None, t([1.0]), torch.ones(1, 4), LossConfig(icepop_low=0.5, icepop_high=5.0)
    )
    loss.backward()
    close(loss, -1.25)
    close(new.grad, [[0.0, -0.25, -1.0, 0.0]])
    close(m["is_masked_frac"], 0.5)


def test_icepop_sequence_level_by_hand() -> None:
    # seq 0: ratios [0.1, 0.2], geometric mean sqrt(0.02) = 0.1414214 < 0.5: both tokens rejected
    # seq 1: ratios [1, 4],     geometric mean 2: both tokens weighted 2
    # A = +1: per token [0, 0, -2, -2]; token-mean -4 / 4 = -1.0; masked fraction 2 / 4
    mu = t([[ln(0.05)] * 2, [ln(0.05)] * 2])
    new = mu + t([[ln(0.1), ln(0.2)], [0.0, ln(4.0)]])
    loss, m = icepop_loss(new, mu, None, t([1.0, 1.0]), torch.ones(2, 2), LossConfig(is_level="sequence"))
    close(loss, -1.0)
    close(m["is_masked_frac"], 0.5)


# ---------------------------------------------------------------- GSPO


def _gspo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # seq 0 (2 tokens): token ratios [2, 0.5] -> mean log ratio 0 -> s = 1
    # seq 1 (3 tokens): token ratios [4, 1, 1] -> mean log ratio ln4 / 3 -> s = 4^(1/3) = 1.5874011
    mu = t([[ln(0.1)] * 3, [ln(0.1)] * 3])
    new = (mu + t([[ln(2.0), ln(0.5), 0.0], [ln(4.0), 0.0, 0.0]])).detach().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return new, mu, mask


def test_gspo_by_hand_seq_mean() -> None:
    # A = +1 both; eps 4e-4 above: seq 0 loss -1 (s = 1, not clipped); seq 1 clipped at -1.0004
    # seq-mean: (-1 - 1.0004) / 2 = -1.0002
    # gradient of seq 0: d(-A s)/d logp_t = -s / |y| = -1 / 2, over 2 sequences: -0.25 per token; seq 1: 0
    new, mu, mask = _gspo_inputs()
    loss, m = gspo_loss(new, mu, None, t([1.0, 1.0]), mask, LossConfig(aggregation="seq-mean"))
    loss.backward()
    close(loss, -1.0002)
    close(new.grad, [[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]])
    close(m["clip_frac"], 3 / 5)  # seq 1's three tokens of five


def test_gspo_token_mean_weights_by_length() -> None:
    # token-mean: (2 x -1 + 3 x -1.0004) / 5 = -5.0012 / 5 = -1.00024
    new, mu, mask = _gspo_inputs()
    loss, _ = gspo_loss(new, mu, None, t([1.0, 1.0]), mask, LossConfig(aggregation="token-mean"))
    close(loss, -1.00024)


def test_gspo_sequence_advantage_is_row_mean() -> None:
    # per-token advantages [2, 0, (pad 9)] on seq 0 -> A = 1; [1, 1, 1] on seq 1 -> A = 1: same as above
    new, mu, mask = _gspo_inputs()
    adv = t([[2.0, 0.0, 9.0], [1.0, 1.0, 1.0]])
    loss, _ = gspo_loss(new, mu, None, adv, mask, LossConfig(aggregation="seq-mean"))
    close(loss, -1.0002)


# ---------------------------------------------------------------- aggregation and normalisers


def _agg_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # r = 1 (new = mu), so the per-token loss is -A:
    #   seq 0: one valid token, A = 3 -> [-3];  seq 1: three valid tokens, A = 1 -> [-1, -1, -1]
    mu = t([[ln(0.5)] * 3] * 2)
    adv = t([[3.0, 7.0, 7.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    return mu, adv, mask


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", -1.5),  # (-3 - 3) / 4
        ("seq-mean", -2.0),  # (-3 / 1 + -3 / 3) / 2
        ("seq-mean-token-sum", -0.75),  # (-3 / 4 + -3 / 4) / 2 with norm_length 4
    ],
)
def test_aggregation_by_hand(aggregation: str, expected: float) -> None:
    mu, adv, mask = _agg_inputs()
    cfg = LossConfig(aggregation=aggregation, norm_length=4)
    loss, _ = ppo_loss(mu.clone(), mu, None, adv, mask, cfg)
    close(loss, expected)


def test_explicit_normaliser_replaces_the_count() -> None:
    # token-mean with a global count of 8 tokens: -6 / 8 = -0.75; seq-mean over 4 sequences: -4 / 4 = -1
    mu, adv, mask = _agg_inputs()
    close(ppo_loss(mu.clone(), mu, None, adv, mask, LossConfig(), normaliser=8)[0], -0.75)
    close(
        ppo_loss(mu.clone(), mu, None, adv, mask, LossConfig(aggregation="seq-mean"), normaliser=4)[0], -1.0
    )
    assert int(loss_units(mask, "token-mean")) == 4 and int(loss_units(mask, "seq-mean")) == 2


def _random_batch(seed: int, b: int = 6, width: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 7, 3, 5, 2, 6][:b])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(F64)
    mask[2, 0] = 0.0  # a masked token inside a sequence (loss_mask of a resubmitted prefix)
    mu = -torch.rand(b, width, generator=g, dtype=F64) * 3
    return {
        "mu": mu,
        "prox": mu + (torch.rand(b, width, generator=g, dtype=F64) - 0.5),
        "new": mu + (torch.rand(b, width, generator=g, dtype=F64) - 0.5) * 0.6,
        "ref": mu + (torch.rand(b, width, generator=g, dtype=F64) - 0.5) * 0.3,
        "adv": torch.randn(b, generator=g, dtype=F64),
        "mask": mask,
    }


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "seq-mean-token-sum"])
def test_micro_batches_with_global_normaliser_sum_to_the_full_batch(name: str, aggregation: str) -> None:
    cfg = LossConfig(
        policy_loss=name, aggregation=aggregation, kl_coef=0.05, is_level="sequence", gspo_eps_high=0.1
    )
    d = _random_batch(0)
    full_new = d["new"].clone().requires_grad_(True)
    full, _ = compute_policy_loss(full_new, d["mu"], d["prox"], d["adv"], d["mask"], cfg, logp_ref=d["ref"])
    full.backward()

    normaliser = loss_units(d["mask"], aggregation)
    micro_new = d["new"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for rows, width in [([0, 1], 7), ([2, 3], 5), ([4, 5], 6)]:  # each micro-batch padded to its own width
        sl = (rows, slice(0, width))
        part, _ = compute_policy_loss(
            micro_new[sl],
            d["mu"][sl],
            d["prox"][sl],
            d["adv"][rows],
            d["mask"][sl],
            cfg,
            logp_ref=d["ref"][sl],
            normaliser=normaliser,
        )
        part.backward()
        total = total + part.detach()
    close(total, full.item(), atol=1e-12)
    torch.testing.assert_close(micro_new.grad, full_new.grad, atol=1e-12, rtol=0)
    assert full_new.grad.abs().sum() > 0


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "seq-mean-token-sum"])
def test_all_masked_batch_gives_zero_loss_and_finite_zero_gradient(name: str, aggregation: str) -> None:
    # padding may hold garbage (NaN, inf): it must reach neither the loss nor the gradient
    # (column 1: finite log-probs with a NaN advantage, which only the input sanitising keeps out of the grad)
    new = leaf([[float("nan"), 0.3, 0.5]])
    mu = t([[float("nan"), 0.0, float("inf")]])
    cfg = LossConfig(policy_loss=name, aggregation=aggregation, kl_coef=0.1)
    loss, metrics = compute_policy_loss(
        new, mu, mu, t([[1.0, float("nan"), 2.0]]), torch.zeros(1, 3), cfg, logp_ref=mu
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(new.grad, torch.zeros(1, 3, dtype=F64))
    assert all(torch.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_nan_in_padding_does_not_leak_into_a_real_batch(name: str) -> None:
    new = leaf([[ln(0.5), float("nan"), 0.2]])
    mu = t([[ln(0.5), float("nan"), 0.0]])
    adv = t([[1.0, 1.0, float("nan")]])
    loss, _ = compute_policy_loss(
        new, mu, None, adv, torch.tensor([[1.0, 0.0, 0.0]]), LossConfig(policy_loss=name)
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert new.grad[0, 0] < 0 and new.grad[0, 1:].eq(0).all()  # A > 0 pushes the real token's log-prob up


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("diff", [50.0, -50.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_ratios_stay_finite(name: str, diff: float, sign: float) -> None:
    # logp_new - logp_behaviour = +-50 nats (and the proximal policy as far away): exp(50) = 5e21 would
    # overflow float32; clamped to +-20 every weight is finite
    mu = torch.full((1, 2), -60.0, dtype=torch.float32)
    new = (mu + diff).requires_grad_(True)
    for prox in (None, mu + diff):
        cfg = LossConfig(policy_loss=name, kl_coef=0.1, is_level="token")
        loss, metrics = compute_policy_loss(
            new, mu, prox, torch.tensor([sign]), torch.ones(1, 2), cfg, logp_ref=mu
        )
        loss.backward()
        assert torch.isfinite(loss), (name, diff, sign, prox is None)
        assert torch.isfinite(new.grad).all()
        assert all(torch.isfinite(v) for v in metrics.values()), metrics
        new.grad = None


def test_extreme_ratio_values_by_hand() -> None:
    # diff +50 is clamped to +20: r = exp(20) = 4.851652e8
    e20 = math.exp(20.0)
    mu, one = t([[0.0]]), torch.ones(1, 1)
    # PPO, A = +1: clipped at -(1.28); A = -1: -A r = +exp(20) (finite) without the dual clip, 3 with it
    close(ppo_loss(t([[50.0]]), mu, None, t([1.0]), one, LossConfig())[0], -1.28)
    no_dual = LossConfig(dual_clip=None)
    close(ppo_loss(t([[50.0]]), mu, None, t([-1.0]), one, no_dual)[0], e20, atol=1.0)
    close(ppo_loss(t([[50.0]]), mu, None, t([-1.0]), one, LossConfig())[0], 3.0)
    # decoupled PPO: w = prox / mu = exp(20) > cap 5 is masked: loss 0
    close(decoupled_ppo_loss(t([[50.0]]), mu, t([[50.0]]), t([1.0]), one, LossConfig())[0], 0.0)
    # TIS: w = min(exp(20), 2) = 2, r = 1: loss -2 A = -2
    close(tis_loss(t([[50.0]]), mu, None, t([1.0]), one, LossConfig(tis_cap=2.0))[0], -2.0)
    # diff -50: w = exp(-20) = 2.061154e-9 (inside no band): icepop rejects it (< 0.5), TIS keeps it
    close(icepop_loss(t([[-50.0]]), mu, None, t([1.0]), one, LossConfig())[0], 0.0)
    close(tis_loss(t([[-50.0]]), mu, None, t([1.0]), one, LossConfig())[0], -math.exp(-20.0), atol=1e-15)


def test_k3_kl_to_reference_by_hand() -> None:
    # new = ln 0.5, ref = ln 0.25: d = ref - new = -ln 2; k3 = e^d - d - 1 = 0.5 + 0.6931472 - 1 = 0.1931472
    # A = 0 so the policy term is 0; loss = 0.1 x 0.1931472 = 0.01931472
    # d k3 / d new = 1 - e^d = 0.5, x 0.1 = 0.05
    new = leaf([[ln(0.5)]])
    cfg = LossConfig(policy_loss="ppo", kl_coef=0.1)
    loss, m = ppo_loss(new, t([[ln(0.5)]]), None, t([0.0]), torch.ones(1, 1), cfg, logp_ref=t([[ln(0.25)]]))
    loss.backward()
    close(loss, 0.01931472)
    close(new.grad, [[0.05]])
    close(m["kl_ref"], 0.1931472)
    with pytest.raises(ValueError, match="kl_coef"):
        ppo_loss(new, t([[0.0]]), None, t([0.0]), torch.ones(1, 1), cfg)


def test_gradient_through_softmax_moves_the_right_way() -> None:
    # logits z = 0 over 3 tokens: p = 1/3 each; token 0 sampled on-policy (mu = p), A = +1, one token:
    # loss = -A r, d loss / d z = -A (onehot - p) = [-2/3, +1/3, +1/3]
    for adv, expected in [(1.0, [-2 / 3, 1 / 3, 1 / 3]), (-1.0, [2 / 3, -1 / 3, -1 / 3])]:
        z = torch.zeros(3, dtype=F64, requires_grad=True)
        logp = torch.log_softmax(z, dim=0)[0].reshape(1, 1)
        loss, _ = ppo_loss(logp, logp.detach(), None, t([adv]), torch.ones(1, 1), LossConfig())
        loss.backward()
        close(z.grad, expected)
        with torch.no_grad():
            stepped = torch.softmax(z - 0.5 * z.grad, dim=0)[0]
        assert (stepped > 1 / 3) == (adv > 0)


def test_mask_truncated_by_hand() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    out = mask_truncated(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="truncated"):
        mask_truncated(mask, torch.tensor([True]))


def test_shape_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="logp_behaviour"):
        ppo_loss(t([[0.0, 0.0]]), t([[0.0]]), None, t([1.0]), torch.ones(1, 2), LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        ppo_loss(t([[0.0, 0.0]]), t([[0.0, 0.0]]), None, t([1.0, 2.0]), torch.ones(1, 2), LossConfig())


def test_aggregate_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(t([[1.0]]), torch.ones(1, 1), "median")  # type: ignore[arg-type]


# ---------------------------------------------------------------- selection by name


def test_every_loss_is_selectable_by_name_and_differs() -> None:
    assert set(POLICY_LOSSES) == {"ppo", "decoupled_ppo", "tis", "icepop", "gspo"}
    d = _random_batch(1)
    # behaviour weights prox / mu from e^-2 = 0.14 to e^2 = 7.4: decoupled_ppo masks those above 5, tis
    # truncates those above 2, icepop rejects those outside [0.5, 5], so no two losses coincide
    d["prox"] = d["mu"] + torch.linspace(-2.0, 2.0, d["mu"].numel(), dtype=F64).reshape(d["mu"].shape)
    values = {}
    for name in POLICY_LOSSES:
        cfg = load([f"--learner.loss.policy_loss={name}"]).learner.loss
        assert cfg.policy_loss == name
        values[name], _ = compute_policy_loss(d["new"], d["mu"], d["prox"], d["adv"], d["mask"], cfg)
        direct, _ = POLICY_LOSSES[name](d["new"], d["mu"], d["prox"], d["adv"], d["mask"], cfg)
        close(values[name], direct.item())
    assert len({round(v.item(), 9) for v in values.values()}) == len(values)


def test_loss_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="learner.loss.policy_loss"):
        load(["--learner.loss.policy_loss=reinforce"])
    with pytest.raises(ConfigError, match="icepop_low"):
        load(["--learner.loss.icepop_low=6", "--learner.loss.icepop_high=5"])


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_sees_the_behaviour_policy_when_proximal_is_the_current_policy(name: str) -> None:
    # a trainer with one optimizer step per batch passes logp_proximal = sg(logp_new); the loss must still
    # correct for mu: moving mu changes the loss (pi / mu from 1.0 to 3.0 moves every loss's weight or ratio)
    new = t([[ln(0.3), ln(0.6)]])
    cfg = LossConfig(policy_loss=name, tis_cap=10.0, behav_cap=10.0)
    values = [
        compute_policy_loss(new, new - shift, new.detach(), t([1.0]), torch.ones(1, 2), cfg)[0].item()
        for shift in (0.0, ln(3.0))
    ]
    assert values[0] != pytest.approx(values[1]), values


@pytest.mark.parametrize(
    "estimator,value,grad",
    [
        # d = new - ref = ln 0.5 - ln 0.25 = ln 2 = 0.6931472
        ("k1", 0.6931472, 1.0),  # k1 = d; d k1 / d new = 1
        ("k2", 0.2402265, 0.6931472),  # k2 = d^2 / 2 = 0.480453 / 2; gradient d
        ("k3", 0.1931472, 0.5),  # k3 = e^-d + d - 1 = 0.5 + 0.6931472 - 1; gradient 1 - e^-d
    ],
)
def test_kl_estimators_by_hand(estimator: str, value: float, grad: float) -> None:
    # A = 0, so the loss is kl_coef x k alone: 0.1 x value, gradient 0.1 x grad
    new = leaf([[ln(0.5)]])
    cfg = LossConfig(policy_loss="decoupled_ppo", kl_coef=0.1, kl_estimator=estimator)
    ref = t([[ln(0.25)]])
    loss, m = decoupled_ppo_loss(new, t([[ln(0.5)]]), None, t([0.0]), torch.ones(1, 1), cfg, logp_ref=ref)
    loss.backward()
    close(loss, 0.1 * value)
    close(new.grad, [[0.1 * grad]])
    close(m["kl_ref"], value)


def test_kl_as_reward_penalty_leaves_the_loss_alone_but_reports_it() -> None:
    new = leaf([[ln(0.5)]])
    cfg = LossConfig(kl_coef=0.1, kl_mode="reward")
    loss, m = ppo_loss(new, t([[ln(0.5)]]), None, t([0.0]), torch.ones(1, 1), cfg, logp_ref=t([[ln(0.25)]]))
    loss.backward()
    close(loss, 0.0)
    close(new.grad, [[0.0]])
    close(m["kl_ref"], 0.1931472)  # k3, the default estimator


def test_entropy_bonus_by_hand() -> None:
    # valid entropies 1, 2, 3 (the fourth is masked): token-mean 6 / 3 = 2; bonus -0.1 x 2 = -0.2
    # gradient -0.1 / 3 on each valid token; seq-mean: rows (1 + 2) / 2 = 1.5 and 3 -> 2.25, bonus -0.225
    ent = leaf([[1.0, 2.0], [3.0, 7.0]])
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    from learner.losses import entropy_bonus

    bonus = entropy_bonus(ent, mask, LossConfig(entropy_coef=0.1))
    bonus.backward()
    close(bonus, -0.2)
    close(ent.grad, [[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]])
    close(entropy_bonus(ent, mask, LossConfig(entropy_coef=0.1, aggregation="seq-mean")), -0.225)
    close(entropy_bonus(ent, mask, LossConfig(entropy_coef=0.1), normaliser=6), -0.1)  # global count 6


def test_gspo_sequence_log_ratio_is_capped() -> None:
    # every token 5 nats above mu, A = -1: the sequence log-ratio 5 is capped at 1, so -A max(r, clip r) = e
    new, mu, mask = t([[5.0, 5.0]]), t([[0.0, 0.0]]), torch.ones(1, 2)
    free = LossConfig(dual_clip=None)
    close(gspo_loss(new, mu, None, t([-1.0]), mask, free)[0], math.e)
    close(
        gspo_loss(new, mu, None, t([-1.0]), mask, LossConfig(dual_clip=None, gspo_log_ratio_cap=2.0))[0],
        math.e**2,
    )
    # cap 2 (ratio e^2 = 7.39) above the dual clip's 3: the dual clip bounds it
    close(gspo_loss(new, mu, None, t([-1.0]), mask, LossConfig(gspo_log_ratio_cap=2.0))[0], 3.0)
