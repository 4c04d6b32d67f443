"""Shared prompt segments: a group's prompt runs once and the learner's numbers do not change.

``share_prompts`` / ``collate(rows=...)`` build the segments by hand-checkable rules, packed into one row
(varlen) or one padded row each; the forward through ``learner.attention`` gives each sample the log-probs of
a forward of that sample alone (the tree of a segment: each output sees the prompt and itself, never a
sibling, and nothing of the row's other segments). The update equals the hand-computed GRPO gradient in
tests/test_learner_gradient.py and the 2-rank FSDP2 run in tests/test_learner_fsdp.py, both with shared rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.attention import PACKED_ATTENTION, register_packed_attention
from learner.packing import (
    ATTENTION_BUCKET_TOKENS,
    TrainSequence,
    collate,
    plan_rows,
    rank_micro_batches,
    row_lengths,
    share_prompts,
)
from learner.step import sample_logprobs
from rollout_fleet.model import init_tiny_model
from tests.learner_batch import make_sequences
from tests.reference_logprobs import gather_logprobs

pytestmark = pytest.mark.timeout(60)


def _seq(prompt: list[int], n_out: int, index: int, first: int = 50) -> TrainSequence:
    return TrainSequence(
        prompt_ids=torch.tensor(prompt),
        output_ids=torch.arange(first, first + n_out),
        logprobs=torch.zeros(n_out),
        versions=torch.zeros(n_out, dtype=torch.long),
        loss_mask=torch.ones(n_out),
        advantages=1.0,
        index=index,
    )


def test_share_prompts_by_hand() -> None:
    a, b = [5, 6, 7], [8, 9]
    seqs = [_seq(a, 2, 0), _seq(b, 3, 1), _seq(a, 2, 2), _seq(a, 2, 3), _seq(b, 1, 4), _seq([1], 20, 5)]
    # budget 7: prompt a (3) + two outputs of 2 fill a row; the third a-sample starts a new row
    assert share_prompts(seqs, 7) == [[0, 2], [3], [1, 4], [5]]
    assert row_lengths(seqs, [[0, 2], [3], [1, 4], [5]]) == [7, 5, 6, 21]  # 21: alone, over the budget
    assert share_prompts(seqs, 100) == [[0, 2, 3], [1, 4], [5]]
    rows, plan = plan_rows(seqs, 1, 100, share=False)
    assert rows == [[i] for i in range(6)] and plan.lengths == [s.length for s in seqs]
    with pytest.raises(ValueError, match="token_budget = 0"):
        share_prompts(seqs, 0)


@pytest.mark.parametrize("varlen", [True, False])
def test_shared_rows_hold_each_prompt_once_and_map_back_to_samples(varlen: bool) -> None:
    a, b = [5, 6, 7], [8, 9]
    seqs = [_seq(a, 2, 10, first=20), _seq(a, 4, 11, first=30), _seq(b, 3, 12, first=40)]
    mb = collate(seqs, pad_id=0, rows=[[0, 1], [2]], varlen=varlen)
    rows = mb.packed
    assert mb.shares_prompts and not collate(seqs).shares_prompts
    # samples in the given order; attention takes them longest first (ties in given order)
    assert mb.seq_index.tolist() == [10, 11, 12] and rows.order.tolist() == [1, 0, 2]
    if varlen:  # both segments in one row, no padding
        assert rows.input_ids.tolist() == [[5, 6, 7, 20, 21, 30, 31, 32, 33, 8, 9, 40, 41, 42]]
        assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 2, 3, 4]]
        assert mb.num_tokens == mb.padded_tokens == 9 + 5  # 17 tokens unshared
    else:
        assert rows.input_ids.tolist() == [[5, 6, 7, 20, 21, 30, 31, 32, 33], [8, 9, 40, 41, 42, 0, 0, 0, 0]]
        assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 0, 0, 0]]
        assert mb.num_tokens == 9 + 5 and mb.padded_tokens == 18
    real = mb.attention_mask > 0
    # every real token of every sample is found at its own position in the rows
    assert torch.equal(rows.input_ids.flatten()[rows.source][real], mb.input_ids[real])
    assert torch.equal(rows.position_ids.flatten()[rows.source][real], mb.position_ids[real])
    # and each row position takes its result from a copy of itself
    flat_samples = torch.cat([mb.input_ids[rows.order[s:e], :n].flatten() for s, e, n in rows.buckets])
    in_rows = rows.input_ids.flatten() != 0
    assert torch.equal(flat_samples[rows.target][in_rows], rows.input_ids.flatten()[in_rows])


def test_attention_buckets_keep_short_samples_off_the_longest() -> None:
    prompt = [5, 6]
    long_, short = ATTENTION_BUCKET_TOKENS // 2, 8
    seqs = [_seq(prompt, long_, 0), _seq(prompt, long_, 1), *[_seq(prompt, short, i) for i in range(2, 10)]]
    mb = collate(seqs, rows=[list(range(10))])
    assert mb.packed.buckets == [(0, 1, long_ + 2), (1, 2, long_ + 2), (2, 10, short + 2)]


def test_rows_must_partition_the_samples_and_share_a_prompt() -> None:
    seqs = [_seq([5, 6], 2, 0), _seq([5, 7], 2, 1)]
    with pytest.raises(ValueError, match="share a row but not a prompt"):
        collate(seqs, rows=[[0, 1]])
    with pytest.raises(ValueError, match="each once"):
        collate(seqs, rows=[[0]])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    path = init_tiny_model(tmp_path_factory.mktemp("m") / "model")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    shared = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=register_packed_attention()
    )
    return plain, shared


def _sample_logp(model: torch.nn.Module, mbs: list) -> dict[int, torch.Tensor]:
    """The learner's log-probs of every sample of ``mbs`` (trained tokens; 0 elsewhere), by sample index."""
    out = {}
    for mb in mbs:
        logp, _ = sample_logprobs(model, mb, torch.ones(mb.input_ids.shape[0]), chunk_tokens=64)
        for row, index in enumerate(mb.seq_index.tolist()):
            out[index] = logp[row, : int(mb.attention_mask[row].sum())]
    return out


def _alone_logp(model: torch.nn.Module, seqs: list[TrainSequence]) -> dict[int, torch.Tensor]:
    """The full-logits reference: each sample alone through a plain forward, masked like the learner's."""
    out = {}
    for s in seqs:
        ids = torch.cat([s.prompt_ids, s.output_ids])[None]
        mask = torch.cat([torch.zeros(len(s.prompt_ids)), s.loss_mask])
        out[s.index] = gather_logprobs(model(input_ids=ids).logits, ids)[0] * mask
    return out


@pytest.mark.parametrize("varlen", [True, False])
def test_shared_forward_gives_each_sample_its_own_logprobs(models: tuple, varlen: bool) -> None:
    plain, shared = models
    torch.set_num_threads(1)
    seqs, _ = make_sequences(24, seed=7, group_size=8, max_out=60)
    rows, plan = plan_rows(seqs, 1, 1024, share=True, varlen=varlen)
    assert all(len(r) > 1 for r in rows)
    mbs = rank_micro_batches(seqs, plan, 0, rows=rows, varlen=varlen)
    assert any(mb.input_ids.shape[0] > 8 for mb in mbs)  # several groups (segments) in one micro-batch
    with torch.no_grad():
        got = _sample_logp(shared, mbs)
        want = _alone_logp(plain, seqs)
    assert sorted(got) == sorted(want) == list(range(len(seqs)))
    for i in want:
        torch.testing.assert_close(got[i], want[i], atol=2e-5, rtol=1e-5, msg=f"sample {i}")
    # a sibling's output must not leak in: scrambling one sample's output changes only that sample
    scrambled = list(seqs)
    s = seqs[1]
    scrambled[1] = TrainSequence(
        s.prompt_ids, s.output_ids.flip(0), s.logprobs, s.versions, s.loss_mask, 1.0, 1
    )
    with torch.no_grad():
        again = _sample_logp(shared, rank_micro_batches(scrambled, plan, 0, rows=rows, varlen=varlen))
    assert not torch.allclose(again[1], got[1])
    for i in (0, 2, 7):
        torch.testing.assert_close(again[i], got[i], atol=1e-6, rtol=0)


def test_the_packed_attention_is_sdpa_outside_the_learner(models: tuple) -> None:
    plain, shared = models
    seqs = [_seq([5, 6], 3, 0), _seq([5, 6], 2, 1)]
    with pytest.raises(ValueError, match=PACKED_ATTENTION):
        sample_logprobs(plain, collate(seqs, rows=[[0, 1]]), torch.ones(2), 4)
    # without the packed keywords the model is plain SDPA (padded batches, evaluation, export)
    mb = collate(seqs)
    with torch.no_grad():
        kwargs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
        torch.testing.assert_close(shared(**kwargs).logits, plain(**kwargs).logits)


def test_export_of_a_shared_attention_model_loads_anywhere(models: tuple, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _, shared = models
    shared.save_pretrained(tmp_path / "out")
    assert PACKED_ATTENTION not in (tmp_path / "out" / "config.json").read_text()
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_activation_checkpointing_keeps_the_shared_update(models: tuple) -> None:
    """learner.activation_checkpointing recomputes layers in backward: the shared-row keywords must reach them."""
    import copy

    from learner.config import LearnerConfig
    from learner.step import train_step
    from tests.learner_batch import rank_inputs

    _, shared = models
    torch.set_num_threads(1)
    plain, checkpointed = copy.deepcopy(shared), copy.deepcopy(shared)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain.train()
    checkpointed.train()
    seqs, temps = make_sequences(16, seed=1, group_size=4)
    config = LearnerConfig(world_size=1, micro_batch_tokens=128, max_grad_norm=1e9)
    mbs, mb_temps, normaliser = rank_inputs(seqs, temps, config, 1, 0)
    assert any(m.shares_prompts for m in mbs)
    for model in (plain, checkpointed):
        train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, mb_temps, config, normaliser, 0)
    moved = max(
        float((p - q).abs().max()) for p, q in zip(plain.parameters(), shared.parameters(), strict=True)
    )
    assert moved > 1e-4
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
