"""A fixed, reproducible step batch of TrainSequences for learner tests and benchmarks, and the per-rank inputs
of :func:`learner.step.train_step` built from it exactly as the trainer builds them."""

from __future__ import annotations

import torch

from learner.config import LearnerConfig
from learner.packing import MicroBatch, TrainSequence
from learner.trainer import plan_step_inputs


def make_sequences(
    n: int, seed: int = 0, vocab: int = 101, min_out: int = 4, max_out: int = 40, group_size: int = 1
) -> tuple[list[TrainSequence], list[float]]:
    """``n`` sequences of random lengths with behaviour log-probs near the tiny model's (about -log V), mixed
    temperatures, advantages of both signs and some loss-masked tokens; each run of ``group_size``
    consecutive sequences shares one prompt (a GRPO group). Returns (sequences, temperatures)."""
    gen = torch.Generator().manual_seed(seed)
    seqs, temps = [], []
    prompt = torch.zeros(0, dtype=torch.long)
    for i in range(n):
        if i % group_size == 0:
            prompt = torch.randint(1, vocab, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen)
        o = int(torch.randint(min_out, max_out + 1, (1,), generator=gen))
        mask = (torch.rand(o, generator=gen) > 0.1).float()
        seqs.append(
            TrainSequence(
                prompt_ids=prompt,
                output_ids=torch.randint(1, vocab, (o,), generator=gen),
                logprobs=-4.6 + 0.3 * torch.randn(o, generator=gen),
                versions=torch.zeros(o, dtype=torch.long),
                loss_mask=mask,
                advantages=float(torch.randn(1, generator=gen)),
                index=i,
            )
        )
        temps.append(1.0 if i % 3 else 0.7)
    return seqs, temps


def rank_inputs(
    seqs: list[TrainSequence], temps: list[float], config: LearnerConfig, world_size: int, rank: int
) -> tuple[list[MicroBatch], list[torch.Tensor], float]:
    """This rank's micro-batches, per-row temperatures and the step's global normaliser (as the trainer does)."""
    inputs = plan_step_inputs(seqs, temps, config, world_size)
    return inputs.micro_batches[rank], inputs.temperatures[rank], inputs.normaliser
