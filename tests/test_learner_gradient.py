"""The learner's update on a real (padded, multi-micro-batch) step equals the plain on-policy GRPO gradient
computed by hand, one unpadded sequence at a time.

At staleness 0 (behaviour log-probs = the learner's own), decoupled PPO with ``pi_prox = sg(pi)`` has ratio 1
and weight 1, so its gradient must be REINFORCE's: ``-sum_i A_i sum_t grad log pi(y_it) / N_tokens``. The
packing tests compare forward VALUES of padded rows; this compares the GRADIENT that train_step applies, so
padding, attention masks, position ids, temperatures, loss masks and the normaliser are all covered at once,
and so are the packed (varlen) rows and the chunked lm-head loss, whose gradient must reach the tied embedding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.attention import register_packed_attention
from learner.config import LearnerConfig, LossConfig
from learner.packing import TrainSequence
from learner.step import train_step
from rollout_fleet.model import init_tiny_model
from tests.learner_batch import make_sequences, rank_inputs

pytestmark = pytest.mark.timeout(60)


def _unpadded_logp(model: torch.nn.Module, s: TrainSequence, temperature: float) -> torch.Tensor:
    """``[O]`` log-probs of the output tokens from a forward of this sequence alone (no padding, no mask)."""
    ids = torch.cat([s.prompt_ids, s.output_ids])[None]
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(s.prompt_ids) - 1 :]


@pytest.mark.parametrize(
    "policy_loss,group_size,flat_groups,varlen",
    [
        ("decoupled_ppo", 1, 0, True),
        ("ppo", 1, 0, True),
        ("tis", 1, 0, True),
        ("decoupled_ppo", 4, 0, True),
        ("decoupled_ppo", 4, 1, True),
        ("decoupled_ppo", 1, 0, False),
        ("decoupled_ppo", 4, 0, False),
    ],
)
def test_padded_step_update_equals_hand_grpo_gradient(
    tmp_path: Path, policy_loss: str, group_size: int, flat_groups: int, varlen: bool
) -> None:
    """group_size 4: samples share prompts, so the step runs shared rows (each prompt once). flat_groups: that
    many groups have advantage 0 (all-equal rewards); the step leaves them out of the forward but not out of
    the normaliser, so the update is still the whole step's. varlen: each micro-batch is one unpadded row;
    otherwise one padded row per sequence or shared prompt."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        init_tiny_model(tmp_path / "m"),
        dtype=torch.float32,
        attn_implementation=register_packed_attention(),
    )
    raw, temps = make_sequences(10, seed=3, group_size=group_size)
    with torch.no_grad():  # on-policy: the behaviour log-probs are the model's own
        seqs = [
            TrainSequence(s.prompt_ids, s.output_ids, _unpadded_logp(model, s, t), s.versions,
                          s.loss_mask, s.advantages, s.index)
            for s, t in zip(raw, temps, strict=True)
        ]  # fmt: skip
    flat = set(range(flat_groups * group_size))
    seqs = [
        TrainSequence(s.prompt_ids, s.output_ids, s.logprobs, s.versions, s.loss_mask, 0.0, s.index)
        if s.index in flat else s
        for s in seqs
    ]  # fmt: skip
    config = LearnerConfig(
        world_size=1,
        micro_batch_tokens=96,
        varlen=varlen,
        loss_chunk_tokens=7,  # several chunks per micro-batch, the last one short
        max_grad_norm=1e9,
        loss=LossConfig(policy_loss=policy_loss),
    )
    mbs, mb_temps, normaliser = rank_inputs(seqs, temps, config, 1, 0)
    assert len(mbs) > 1 and any(int(m.attention_mask.sum()) < m.attention_mask.numel() for m in mbs)
    padded = sum(m.padded_tokens for m in mbs) - sum(m.num_tokens for m in mbs)
    assert (padded == 0) == varlen
    shared = [m for m in mbs if m.shares_prompts]
    assert bool(shared) == (group_size > 1)
    if group_size > 1:  # each shared row holds its prompt once
        assert sum(m.num_tokens for m in mbs) < sum(s.length for s in seqs)
    run = {i for m in mbs for i in m.seq_index.tolist() if i >= 0}
    assert run == set(range(len(seqs))) - flat

    # by hand: per sequence, unpadded, REINFORCE with the token-mean normaliser
    model.zero_grad()
    for s, t in zip(seqs, temps, strict=True):
        logp = _unpadded_logp(model, s, t)
        (-(float(s.advantages) * logp * s.loss_mask).sum() / normaliser).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert sum(float(g.norm()) for g in expected.values()) > 1e-3

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # the update IS minus the gradient
    head_tokens: list[int] = []  # the lm-head's input sizes: the step never makes [tokens, vocab] logits
    hook = model.lm_head.register_forward_hook(lambda m, args, out: head_tokens.append(args[0].shape[0]))
    result = train_step(model, opt, mbs, mb_temps, config, normaliser, learner_version=0)
    hook.remove()
    assert result.applied
    assert head_tokens == [0] * len(mbs)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=2e-6, rtol=1e-4, msg=name)
