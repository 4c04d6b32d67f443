"""Shared prompt rows: a group's prompt runs once per row and the learner's numbers do not change.

``share_prompts`` / ``collate(rows=...)`` build the rows by hand-checkable rules; the forward through
``learner.attention`` gives the per-sample log-probs of the ordinary padded forward (the tree of a row: each
output sees the prompt and itself, never a sibling). The update equals the hand-computed GRPO gradient in
tests/test_learner_gradient.py and the 2-rank FSDP2 run in tests/test_learner_fsdp.py, both with shared rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.attention import SHARED_PROMPT_ATTENTION, register_shared_prompt_attention
from learner.packing import (
    ATTENTION_BUCKET_TOKENS,
    TrainSequence,
    collate,
    gather_logprobs,
    plan_rows,
    rank_micro_batches,
    row_lengths,
    share_prompts,
)
from learner.step import forward_logits
from rollout_fleet.model import init_tiny_model
from tests.learner_batch import make_sequences

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


def test_shared_rows_hold_each_prompt_once_and_map_back_to_samples() -> None:
    a, b = [5, 6, 7], [8, 9]
    seqs = [_seq(a, 2, 10, first=20), _seq(a, 4, 11, first=30), _seq(b, 3, 12, first=40)]
    mb = collate(seqs, pad_id=0, rows=[[0, 1], [2]])
    rows = mb.shared
    assert rows is not None
    # samples laid out longest first (ties in given order); seq_index says which is which
    assert mb.seq_index.tolist() == [11, 10, 12]
    assert rows.input_ids.tolist() == [[5, 6, 7, 20, 21, 30, 31, 32, 33], [8, 9, 40, 41, 42, 0, 0, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 0, 0, 0]]
    assert mb.num_tokens == 9 + 5 and mb.padded_tokens == 18  # 17 tokens unshared
    real = mb.attention_mask > 0
    # every real token of every sample is found at its own position in the rows
    assert torch.equal(rows.input_ids.flatten()[rows.source][real], mb.input_ids[real])
    assert torch.equal(rows.position_ids.flatten()[rows.source][real], mb.position_ids[real])
    # and each row position takes its result from a copy of itself
    flat_samples = torch.cat([mb.input_ids[s:e, :n].flatten() for s, e, n in rows.buckets])
    in_rows = rows.input_ids.flatten() != 0
    assert torch.equal(flat_samples[rows.target][in_rows], rows.input_ids.flatten()[in_rows])


def test_attention_buckets_keep_short_samples_off_the_longest() -> None:
    prompt = [5, 6]
    long_, short = ATTENTION_BUCKET_TOKENS // 2, 8
    seqs = [_seq(prompt, long_, 0), _seq(prompt, long_, 1), *[_seq(prompt, short, i) for i in range(2, 10)]]
    mb = collate(seqs, rows=[list(range(10))])
    assert mb.shared is not None
    assert mb.shared.buckets == [(0, 1, long_ + 2), (1, 2, long_ + 2), (2, 10, short + 2)]


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
        path, dtype=torch.float32, attn_implementation=register_shared_prompt_attention()
    )
    return plain, shared


def _sample_logp(model: torch.nn.Module, mbs: list) -> dict[int, torch.Tensor]:
    out = {}
    for mb in mbs:
        logp = gather_logprobs(forward_logits(model, mb), mb.input_ids) * mb.loss_mask
        for row, index in enumerate(mb.seq_index.tolist()):
            out[index] = logp[row, : int(mb.attention_mask[row].sum())]
    return out


def test_shared_forward_gives_each_sample_its_own_logprobs(models: tuple) -> None:
    plain, shared = models
    torch.set_num_threads(1)
    seqs, _ = make_sequences(24, seed=7, group_size=8, max_out=60)
    rows, plan = plan_rows(seqs, 1, 512, share=True)
    assert all(len(r) > 1 for r in rows)
    with torch.no_grad():
        got = _sample_logp(shared, rank_micro_batches(seqs, plan, 0, rows=rows))
        single = [[i] for i in range(len(seqs))]
        _, plain_plan = plan_rows(seqs, 1, 512, share=False)
        want = _sample_logp(plain, rank_micro_batches(seqs, plain_plan, 0, rows=single))
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
        again = _sample_logp(shared, rank_micro_batches(scrambled, plan, 0, rows=rows))
    assert not torch.allclose(again[1], got[1])
    for i in (0, 2, 7):
        torch.testing.assert_close(again[i], got[i], atol=1e-6, rtol=0)


def test_shared_rows_need_the_shared_attention(models: tuple) -> None:
    plain, shared = models
    seqs = [_seq([5, 6], 3, 0), _seq([5, 6], 2, 1)]
    mb = collate(seqs, rows=[[0, 1]])
    with pytest.raises(ValueError, match=SHARED_PROMPT_ATTENTION):
        forward_logits(plain, mb)
    # without shared rows the shared-attention model is plain SDPA
    unshared = collate(seqs)
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(shared, unshared), forward_logits(plain, unshared))


def test_export_of_a_shared_attention_model_loads_anywhere(models: tuple, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _, shared = models
    shared.save_pretrained(tmp_path / "out")
    assert SHARED_PROMPT_ATTENTION not in (tmp_path / "out" / "config.json").read_text()
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
    assert any(m.shared is not None for m in mbs)
    for model in (plain, checkpointed):
        train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, mb_temps, config, normaliser, 0)
    moved = max(
        float((p - q).abs().max()) for p, q in zip(plain.parameters(), shared.parameters(), strict=True)
    )
    assert moved > 1e-4
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
