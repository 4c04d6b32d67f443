"""Batched sampling: greedy, temperature, top-k / top-p / min-p, seeds, banned tokens, and the log-prob returned."""

from __future__ import annotations

import torch

from rollout_fleet.engine.protocol import SamplingParams
from rollout_fleet.engine.sampler import SamplingBatch, filter_sorted, make_generator, sample

torch.set_num_threads(1)
CPU = torch.device("cpu")


def batch_of(params: list[SamplingParams], generators=None, vocab: int = 8) -> SamplingBatch:
    return SamplingBatch.build(params, generators or [None] * len(params), vocab, CPU)


def test_greedy_rows_take_argmax_with_untempered_logprob() -> None:
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5e-7),
        SamplingParams(temperature=0.0),
    ]
    tokens, lps = sample(logits, batch_of(params), torch.Generator().manual_seed(1))
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(lps, expected)


def test_sampled_logprob_is_tempered_and_not_renormalised_after_truncation() -> None:
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0),
    ]
    tokens, lps = sample(logits, batch_of(params), torch.Generator().manual_seed(3))
    temps = torch.tensor([0.7, 1.3, 1.0, 1.0])
    expected = torch.log_softmax(logits / temps[:, None], -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(lps, expected, atol=1e-6)
    assert tokens[3] == logits[3].argmax()


def test_inverse_cdf_matches_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.0, 0.7])
    logits = probs.log().expand(20000, 4).contiguous()
    tokens, _ = sample(
        logits, batch_of([SamplingParams()] * 20000, vocab=4), torch.Generator().manual_seed(4)
    )
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert freq[2] == 0  # a zero-probability token is never drawn
    assert torch.allclose(freq, probs, atol=0.015)


def test_truncation_keeps_only_allowed_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).expand(3000, 6).contiguous()
    cases = {
        "top_k": (SamplingParams(top_k=2), {0, 1}),
        "top_p": (SamplingParams(top_p=0.8), {0, 1}),  # mass before token 2 is 0.91 > 0.8
        "min_p": (SamplingParams(min_p=0.2), {0, 1}),  # 0.2 x p(0) lies between p(1) and p(2)
        "top_k_1": (SamplingParams(top_k=1), {0}),
    }
    for name, (params, allowed) in cases.items():
        tokens, _ = sample(logits, batch_of([params] * 3000, vocab=6), torch.Generator().manual_seed(5))
        assert set(tokens.tolist()) == allowed, name


def test_filter_sorted_top_p_keeps_the_most_likely_token() -> None:
    probs = torch.tensor([[0.9, 0.05, 0.05]])
    kept = filter_sorted(probs, None, torch.tensor([0.01]), None)
    assert torch.equal(kept, torch.tensor([[0.9, 0.0, 0.0]]))


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(8, generator=gen) for _ in range(20)]
    alone_gen = make_generator(1234, CPU)
    alone = []
    for row in rows:  # the seeded request decoding alone, one token per step
        tok, _ = sample(
            row[None], batch_of([SamplingParams()], [alone_gen]), torch.Generator().manual_seed(9)
        )
        alone.append(int(tok))
    crowded_gen = make_generator(1234, CPU)
    crowded = []
    for step, row in enumerate(rows):  # the same request in a batch with two unseeded neighbours
        logits = torch.stack([torch.randn(8), row, torch.randn(8)])
        batch = batch_of([SamplingParams()] * 3, [None, crowded_gen, None])
        tok, _ = sample(logits, batch, torch.Generator().manual_seed(step))
        crowded.append(int(tok[1]))
    assert alone == crowded
    other = make_generator(99, CPU)
    different = [int(sample(r[None], batch_of([SamplingParams()], [other]), gen)[0]) for r in rows]
    assert different != alone


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0]]).expand(500, 3).contiguous()
    banned = [(i, [0]) for i in range(500)]
    tokens, lps = sample(
        logits, batch_of([SamplingParams()] * 500, vocab=3), torch.Generator().manual_seed(1), banned
    )
    assert 0 not in tokens.tolist()
    assert torch.allclose(lps, torch.full((500,), float(torch.log(torch.tensor(0.5)))), atol=1e-6)
