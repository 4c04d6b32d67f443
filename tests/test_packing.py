"""Token-budget packing, rank balancing and the micro-batch layouts (checked against a real HF forward of
each sequence alone: packed rows never let one sequence see another)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.attention import register_packed_attention
from learner.config import LossConfig
from learner.losses import compute_policy_loss
from learner.packing import (
    TrainSequence,
    balance_ranks,
    carries_gradient,
    collate,
    plan_micro_batches,
    plan_step,
    rank_micro_batches,
    step_inputs,
    step_loss_units,
)
from learner.step import sample_logprobs
from tests.reference_logprobs import gather_logprobs

torch.set_num_threads(1)


def make_seq(index: int, prompt_len: int, output_len: int, vocab: int = 1000, seed: int = 0) -> TrainSequence:
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    return TrainSequence(
        prompt_ids=torch.randint(1, vocab, (prompt_len,), generator=g),
        output_ids=torch.randint(1, vocab, (output_len,), generator=g),
        logprobs=-torch.rand(output_len, generator=g) * 5,
        versions=torch.randint(0, 4, (output_len,), generator=g),
        loss_mask=(torch.rand(output_len, generator=g) > 0.1).float(),
        advantages=float(torch.randn(1, generator=g)),
        index=index,
    )


def test_plan_micro_batches_by_hand() -> None:
    # sorted longest first: 10 (#0), 9 (#4), 7 (#2), 4 (#5), 3 (#1), 2 (#3); budget 20 padded tokens
    #   [#0, #4]: 2 x 10 = 20 fits; adding #2 would be 3 x 10 = 30
    #   [#2, #5]: 2 x 7 = 14;       adding #1 would be 3 x 7 = 21
    #   [#1, #3]: 2 x 3 = 6
    assert plan_micro_batches([10, 3, 7, 2, 9, 4], 20, varlen=False) == [[0, 4], [2, 5], [1, 3]]
    # varlen, 20 real tokens, first fit: 10 + 9 = 19 (7 does not fit) | 7 + 4 + 3 + 2 = 16
    assert plan_micro_batches([10, 3, 7, 2, 9, 4], 20) == [[0, 4], [2, 5, 1, 3]]
    # first fit goes back to an earlier micro-batch: 12 | 9 (12 + 9 > 20) | 8 -> with 12 (20) | 2 -> with 9
    assert plan_micro_batches([12, 9, 8, 2], 20) == [[0, 2], [1, 3]]


def test_a_sequence_over_the_budget_gets_its_own_micro_batch() -> None:
    # 50 > 20: alone; then 5 and 5 (2 x 5 = 10) together
    for varlen in (True, False):
        assert plan_micro_batches([50, 5, 5], 20, varlen) == [[0], [1, 2]]
        assert plan_micro_batches([50, 60], 20, varlen) == [[1], [0]]


def test_balance_ranks_by_hand() -> None:
    # longest first to the least-loaded rank: 8 -> r0 (8), 7 -> r1 (7), 6 -> r1 (13), 5 -> r0 (13),
    # 4 -> tie at 13 tokens and 2 sequences each: lower rank r0 (17)
    assert balance_ranks([8, 7, 6, 5, 4], 2) == [[0, 3, 4], [1, 2]]


def test_every_rank_runs_the_same_number_of_micro_batches() -> None:
    # one long sequence (over the budget) on rank 0, six short ones on rank 1, two per micro-batch (2 x 2 = 4);
    # rank 0 is padded with two empty micro-batches
    plan = plan_step([12, 2, 2, 2, 2, 2, 2], world_size=2, token_budget=4)
    assert plan.ranks[0] == [[0], [], []]
    assert [len(mb) for mb in plan.ranks[1]] == [2, 2, 2]
    assert plan.micro_batches_per_rank == 3
    assert plan.rank_tokens() == [12, 12]


def test_more_ranks_than_sequences() -> None:
    plan = plan_step([5], world_size=3, token_budget=100)
    assert plan.ranks == [[[0]], [[]], [[]]]


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches([3], 0)
    with pytest.raises(ValueError, match="world_size"):
        balance_ranks([3], 0)
    with pytest.raises(ValueError, match="length 0"):
        plan_micro_batches([3, 0], 10)
    with pytest.raises(ValueError, match="logprobs has 2 entries, output_ids has 3"):
        TrainSequence([1], [1, 2, 3], [0.0, 0.0], [0, 0, 0], [1, 1, 1], 1.0, index=7)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        TrainSequence([], [1], [0.0], [0], [1], 1.0)


def test_long_tail_step_every_token_once_budgets_balance() -> None:
    # one 30k-token chain of thought and 300 short outputs in one step, 4 ranks, 4096-token micro-batches
    rng = random.Random(0)
    seqs = [make_seq(0, 40, 30_000)]
    seqs += [make_seq(i, rng.randint(5, 40), rng.randint(1, 200)) for i in range(1, 301)]
    world, budget = 4, 4096
    plan = plan_step([s.length for s in seqs], world, budget)

    counts = {len(r) for r in plan.ranks}
    assert len(counts) == 1, counts
    tokens = plan.rank_tokens()
    assert max(tokens) - min(tokens) <= max(s.length for s in seqs)
    short_ranks = [t for r, t in zip(plan.ranks, tokens, strict=True) if not any(0 in mb for mb in r)]
    assert max(short_ranks) - min(short_ranks) <= 240  # the short ones balance to within one short sequence

    seen: dict[int, int] = {}
    for rank in range(world):
        for mb in rank_micro_batches(seqs, plan, rank):
            rows = int((mb.seq_index >= 0).sum())
            assert rows == 1 or mb.num_tokens <= budget  # the budget holds, except for a lone long row
            assert mb.padded_tokens == max(1, mb.num_tokens)  # varlen: no padding (the dummy's one token)
            for row, idx in enumerate(mb.seq_index.tolist()):
                if idx < 0:
                    assert mb.is_empty and mb.loss_tokens == 0
                    continue
                seen[idx] = seen.get(idx, 0) + 1
                s = seqs[idx]
                p, n = len(s.prompt_ids), s.length
                assert torch.equal(mb.input_ids[row, :n], torch.cat([s.prompt_ids, s.output_ids]))
                assert int(mb.attention_mask[row].sum()) == n
                assert torch.equal(mb.logp_behaviour[row, p:n], s.logprobs)
                assert torch.equal(mb.versions[row, p:n], s.versions)
                assert torch.equal(mb.loss_mask[row, p:n], s.loss_mask)
                assert mb.loss_mask[row, :p].sum() == 0 and mb.loss_mask[row, n:].sum() == 0
                assert torch.allclose(mb.advantages[row, p:n], s.advantages.expand(n - p))
    assert seen == {i: 1 for i in range(len(seqs))}

    # without varlen, packing by padded size avoids most of the padding that padding to the step's longest
    # sequence would cost
    real = sum(s.length for s in seqs)
    plan = plan_step([s.length for s in seqs], world, budget, varlen=False)
    mbs = [mb for r in range(world) for mb in rank_micro_batches(seqs, plan, r, varlen=False)]
    assert all(mb.num_tokens <= budget or int((mb.seq_index >= 0).sum()) == 1 for mb in mbs)
    padded = sum(mb.padded_tokens for mb in mbs)
    assert padded < 1.2 * real  # measured 1.125, dummy rows included
    assert padded * 100 < len(seqs) * max(s.length for s in seqs)


def test_step_loss_units() -> None:
    a = TrainSequence([1, 2], [3, 4, 5], [0.0] * 3, [0] * 3, [1, 0, 1], 1.0)
    b = TrainSequence([1], [3, 4], [0.0] * 2, [0] * 2, [0, 0], 1.0)
    assert step_loss_units([a, b], "token-mean") == 2
    assert step_loss_units([a, b], "seq-mean") == 1


def test_gather_logprobs_by_hand() -> None:
    # logits at position 0 are [0, ln 3]: p(token 1) = 3 / (1 + 3) = 0.75, so position 1 (token 1) holds ln 0.75
    # at temperature 2 the logits are [0, ln3 / 2]: p = sqrt3 / (1 + sqrt3) = 0.6339746
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1]])
    torch.testing.assert_close(gather_logprobs(logits, ids), torch.tensor([[0.0, math.log(0.75)]]))
    torch.testing.assert_close(
        gather_logprobs(logits, ids, temperature=2.0), torch.tensor([[0.0, math.log(0.6339746)]])
    )


def _tiny_model() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def _packed_model() -> Qwen2ForCausalLM:
    model = _tiny_model()
    model.set_attn_implementation(register_packed_attention())
    return model


@pytest.mark.parametrize("varlen", [True, False])
def test_layout_matches_unpadded_forward_of_each_sequence(varlen: bool) -> None:
    # the learner's forward of a packed micro-batch (several sequences in one row, position ids restarting at
    # each; or one padded row each) gives, for every trained token, the log-prob of a forward of that sequence
    # alone: attention never crosses a sequence, positions and the t-1 -> t shift are right
    model = _packed_model()
    seqs = [make_seq(i, p, o, vocab=64) for i, (p, o) in enumerate([(3, 9), (5, 2), (1, 4), (2, 7)])]
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0])
    mb = collate(seqs, varlen=varlen)
    rows = mb.packed
    if varlen:  # one row, every sequence once, positions restarting at 0
        assert rows.input_ids.shape == (1, sum(s.length for s in seqs)) and mb.padded_tokens == mb.num_tokens
        starts = [0, 12, 19, 24]
        assert [int(rows.position_ids[0, k]) for k in starts] == [0, 0, 0, 0]
        assert rows.position_ids[0, 11] == 11 and rows.position_ids[0, -1] == 8
    else:
        assert rows.input_ids.shape == (4, 12) and mb.padded_tokens == 48
    with torch.no_grad():
        logp, entropy = sample_logprobs(model, mb, temps, chunk_tokens=5)
        for row, s in enumerate(seqs):
            ids = torch.cat([s.prompt_ids, s.output_ids])[None]
            logits = model(input_ids=ids).logits
            alone = gather_logprobs(logits, ids, float(temps[row]))[0]
            p, n = len(s.prompt_ids), s.length
            mask = mb.loss_mask[row, :n]
            assert mask.sum() > 0
            torch.testing.assert_close(logp[row, :n], alone * mask, atol=1e-5, rtol=0)
            assert logp[row, n:].abs().sum() == 0 and logp[row, :p].abs().sum() == 0
            # and the same numbers by hand from the logits at t - 1
            t = p  # first output token
            expected = torch.log_softmax(logits[0, t - 1] / temps[row], -1)[ids[0, t]] * mask[t]
            torch.testing.assert_close(logp[row, t], expected, atol=1e-5, rtol=0)
            lp = torch.log_softmax(logits[0, p - 1 : n - 1] / temps[row], -1)
            torch.testing.assert_close(
                entropy[row, p:n], -(lp.exp() * lp).sum(-1) * mask[p:], atol=1e-5, rtol=0
            )


def test_a_sequence_sees_nothing_of_its_row_neighbours() -> None:
    # scrambling one sequence of a packed row changes only that sequence's log-probs
    model = _packed_model()
    seqs = [make_seq(i, 3, 6, vocab=64) for i in range(3)]
    s = seqs[1]
    scrambled = [seqs[0], TrainSequence(s.prompt_ids.flip(0), s.output_ids.flip(0), s.logprobs, s.versions,
                                        s.loss_mask, s.advantages, 1), seqs[2]]  # fmt: skip
    temps = torch.ones(3)
    with torch.no_grad():
        before, _ = sample_logprobs(model, collate(seqs), temps, 4)
        after, _ = sample_logprobs(model, collate(scrambled), temps, 4)
    assert not torch.allclose(before[1], after[1])
    torch.testing.assert_close(before[[0, 2]], after[[0, 2]], atol=1e-6, rtol=0)


def test_the_learner_forward_needs_the_packed_attention() -> None:
    with pytest.raises(ValueError, match="streamrl_packed"):
        sample_logprobs(_tiny_model(), collate([make_seq(0, 2, 3, vocab=64)]), torch.ones(1), 4)


def test_empty_micro_batch_runs_and_contributes_nothing() -> None:
    # the filler micro-batch of a rank with fewer sequences: the forward/backward run, the gradient is 0
    model = _packed_model().train()
    mb = collate([])
    assert mb.input_ids.shape == (1, 1) and mb.is_empty and mb.num_tokens == 0 and mb.loss_tokens == 0
    logp, _ = sample_logprobs(model, mb, torch.ones(1), 4)
    loss, _ = compute_policy_loss(logp, mb.logp_behaviour, None, mb.advantages, mb.loss_mask, LossConfig())
    loss.backward()
    assert loss.item() == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters()))  # the backward reached every parameter
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_micro_batch_to_device_keeps_every_field() -> None:
    mb = collate([make_seq(0, 2, 3)])
    moved = mb.to("cpu")
    assert torch.equal(moved.input_ids, mb.input_ids) and torch.equal(moved.seq_index, mb.seq_index)


def _with(seq: TrainSequence, advantages: float | torch.Tensor, loss_mask: torch.Tensor | None = None):
    mask = seq.loss_mask if loss_mask is None else loss_mask
    return TrainSequence(
        seq.prompt_ids, seq.output_ids, seq.logprobs, seq.versions, mask, advantages, seq.index
    )


def test_carries_gradient() -> None:
    s = make_seq(0, 3, 4)
    assert carries_gradient(_with(s, 0.5))
    assert not carries_gradient(_with(s, 0.0))
    assert not carries_gradient(_with(s, 0.5, torch.zeros(4)))  # no loss token
    per_token = torch.tensor([0.0, 0.0, 0.3, 0.0])
    assert carries_gradient(_with(s, per_token, torch.tensor([1.0, 1.0, 1.0, 0.0])))
    assert not carries_gradient(_with(s, per_token, torch.tensor([1.0, 1.0, 0.0, 1.0])))


def test_step_inputs_leave_out_zero_advantage_sequences_but_count_them() -> None:
    seqs = [make_seq(i, 3, 5 + i) for i in range(8)]
    seqs = [_with(s, 0.0) if i in (1, 4, 5) else s for i, s in enumerate(seqs)]
    temps = [0.5 + 0.1 * i for i in range(8)]
    full = step_inputs(seqs, temps, 2, 64, False, "token-mean", skip_zero_gradient=False)
    lean = step_inputs(seqs, temps, 2, 64, False, "token-mean", skip_zero_gradient=True)
    assert lean.normaliser == full.normaliser == step_loss_units(seqs, "token-mean")
    assert (lean.skipped, lean.skipped_tokens) == (3, sum(seqs[i].length for i in (1, 4, 5)))
    assert (full.skipped, full.skipped_tokens) == (0, 0)

    def trained(inputs) -> dict[int, float]:  # sequence index -> its rows' temperature
        return {
            i: float(t[row])
            for mbs, temps_ in zip(inputs.micro_batches, inputs.temperatures, strict=True)
            for mb, t in zip(mbs, temps_, strict=True)
            for row, i in enumerate(mb.seq_index.tolist())
            if i >= 0
        }

    assert sorted(trained(full)) == list(range(8))
    assert trained(lean) == {i: pytest.approx(temps[i]) for i in (0, 2, 3, 6, 7)}
    assert len({len(mbs) for mbs in lean.micro_batches}) == 1  # every rank runs the same count


def test_a_step_with_nothing_to_train_still_runs_one_empty_micro_batch_per_rank() -> None:
    seqs = [_with(make_seq(i, 2, 3), 0.0) for i in range(4)]
    inputs = step_inputs(seqs, [1.0] * 4, 2, 64, True, "token-mean", skip_zero_gradient=True)
    assert inputs.skipped == 4
    assert [[mb.is_empty for mb in mbs] for mbs in inputs.micro_batches] == [[True], [True]]
    assert plan_step([], world_size=2, token_budget=8).ranks == [[[]], [[]]]
