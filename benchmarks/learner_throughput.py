"""Learner throughput: trained tokens/s of one optimizer step with token-budget packing against padding every
sequence to the longest of the batch, and with shared prompt rows against one row per sample on a GRPO batch.

Same model (the tiny Qwen2, fp32, CPU, 1 torch thread), same sequences, same loss (decoupled PPO, token-mean),
same micro-batch token budget, one process:

* ``packing``: what the learner does: ``plan_step`` (varlen: longest first into micro-batches of at most
  ``budget`` real tokens, each one unpadded row) then ``rank_micro_batches``.
* ``padding``: every sequence right-padded to the longest sequence of the batch, ``budget // longest`` rows per
  micro-batch (at least one), in the same order.

The batch is long-tailed, as RL outputs are: most outputs 30-60 tokens, a few (``long_fraction``) 8-16x longer.
Each repeat times one ``train_step`` of each way, alternating which goes first; tokens/s counts real (prompt +
output) tokens. Before timing, both ways compute the loss of the same weights, which must agree (the padding is
masked, so it changes the cost and nothing else).

The second comparison is a GRPO step shaped like the built-in task's (16 prompts of 20-30 tokens, 8 samples
each, outputs of 10-60 tokens, so prompts are about 40% of the sample tokens):

* ``shared``: what the learner does with ``learner.share_prompts`` (default): each group's prompt once per
  row, the outputs after it (``learner.attention``).
* ``unshared``: one row per sample (``learner.share_prompts=false``), token-budget packing as above.

Both count the same sample tokens (prompt + output per sample) and must agree on the loss.

    python -m benchmarks.learner_throughput --quick --out runs/learner_throughput.json
    python -m benchmarks.learner_throughput --out benchmarks/results/learner_throughput.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from learner.attention import register_packed_attention
from learner.config import LearnerConfig
from learner.packing import (
    MicroBatch,
    PackedRows,
    TrainSequence,
    collate,
    plan_rows,
    plan_step,
    rank_micro_batches,
    step_loss_units,
)
from learner.step import train_step
from rollout_fleet.model import init_tiny_model

TARGETS = {"ratio_packing_vs_padding": (">=", 2.0), "ratio_shared_vs_unshared": (">=", 1.2)}
MODES = {
    "smoke": {"sequences": 4, "long_fraction": 0.25, "budget": 512, "repeats": 1, "groups": 1},
    "quick": {"sequences": 32, "long_fraction": 0.1, "budget": 2048, "repeats": 3, "groups": 8},
    "full": {"sequences": 64, "long_fraction": 0.06, "budget": 4096, "repeats": 7, "groups": 16},
}
GROUP_SIZE, GRPO_BUDGET = 8, 2048


def grpo_batch(groups: int, vocab: int, seed: int = 1) -> list[TrainSequence]:
    """``groups`` x 8 samples: each group one prompt of 20-30 tokens, outputs of 10-60 tokens."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(groups):
        prompt = torch.randint(1, vocab, (int(torch.randint(20, 31, (1,), generator=gen)),), generator=gen)
        for _ in range(GROUP_SIZE):
            out = int(torch.randint(10, 61, (1,), generator=gen))
            seqs.append(
                TrainSequence(
                    prompt_ids=prompt,
                    output_ids=torch.randint(1, vocab, (out,), generator=gen),
                    logprobs=-4.6 + 0.3 * torch.randn(out, generator=gen),
                    versions=torch.zeros(out, dtype=torch.long),
                    loss_mask=torch.ones(out),
                    advantages=float(torch.randn(1, generator=gen)),
                    index=len(seqs),
                )
            )
    return seqs


def long_tailed_batch(n: int, long_fraction: float, vocab: int, seed: int = 0) -> list[TrainSequence]:
    """``n`` sequences: prompts of 10-30 tokens, outputs of 30-60 tokens, of which ``max(1, n * long_fraction)``
    are 8-16x longer; behaviour log-probs near a uniform policy's, advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    n_long = max(1, round(n * long_fraction))
    long_rows = set(torch.randperm(n, generator=gen)[:n_long].tolist())
    seqs = []
    for i in range(n):
        out = int(torch.randint(30, 61, (1,), generator=gen))
        if i in long_rows:
            out *= int(torch.randint(8, 17, (1,), generator=gen))
        prompt = int(torch.randint(10, 31, (1,), generator=gen))
        seqs.append(
            TrainSequence(
                prompt_ids=torch.randint(1, vocab, (prompt,), generator=gen),
                output_ids=torch.randint(1, vocab, (out,), generator=gen),
                logprobs=-4.6 + 0.3 * torch.randn(out, generator=gen),
                versions=torch.zeros(out, dtype=torch.long),
                loss_mask=torch.ones(out),
                advantages=float(torch.randn(1, generator=gen)),
                index=i,
            )
        )
    return seqs


def pad_to(mb: MicroBatch, width: int, pad_id: int = 0) -> MicroBatch:
    """Right-pad every ``[b, L]`` tensor of ``mb`` to ``[b, width]`` and run it as ``b`` rows of ``width``: the
    token-wise layers and the attention (one bucket, every row padded to ``width``) both pay for the padding,
    which is unattended (it comes after every real token) and unmasked."""
    b, extra = mb.input_ids.shape[0], width - mb.input_ids.shape[1]

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, max(0, extra)), value=value)

    flat = torch.arange(b * width).reshape(b, width)
    rows = PackedRows(
        input_ids=pad(mb.input_ids, pad_id),
        position_ids=torch.arange(width).expand(b, width).clone(),
        source=flat,
        target=flat.flatten(),
        order=torch.arange(b),
        buckets=[(0, b, width)],
        real_tokens=int(mb.attention_mask.sum()),
        # for a varlen kernel each row is one sample of ``width`` tokens, so it too pays for the padding
        varlen_index=flat.flatten(),
        cu_seqlens=torch.arange(0, (b + 1) * width, width, dtype=torch.int32),
        varlen_target=flat.flatten(),
        max_seqlen=width,
    )
    return MicroBatch(
        input_ids=pad(mb.input_ids, pad_id),
        attention_mask=pad(mb.attention_mask, 0),
        position_ids=torch.arange(width).expand(b, width).clone(),
        logp_behaviour=pad(mb.logp_behaviour, 0.0),
        versions=pad(mb.versions, -1),
        loss_mask=pad(mb.loss_mask, 0.0),
        advantages=pad(mb.advantages, 0.0),
        seq_index=mb.seq_index,
        packed=rows,
    )


def packed_micro_batches(seqs: list[TrainSequence], budget: int) -> list[MicroBatch]:
    plan = plan_step([s.length for s in seqs], 1, budget)
    return rank_micro_batches(seqs, plan, 0)


def grpo_micro_batches(seqs: list[TrainSequence], budget: int, share: bool) -> list[MicroBatch]:
    rows, plan = plan_rows(seqs, 1, budget, share)
    return rank_micro_batches(seqs, plan, 0, rows=rows)


def padded_micro_batches(seqs: list[TrainSequence], budget: int) -> list[MicroBatch]:
    longest = max(s.length for s in seqs)
    rows = max(1, budget // longest)
    return [pad_to(collate(seqs[i : i + rows]), longest) for i in range(0, len(seqs), rows)]


def _temps(mbs: list[MicroBatch]) -> list[torch.Tensor]:
    return [torch.ones(mb.input_ids.shape[0]) for mb in mbs]


def _timed_step(model, optimizer, mbs, config, normaliser) -> tuple[float, float]:  # noqa: ANN001
    started = time.perf_counter()
    result = train_step(model, optimizer, mbs, _temps(mbs), config, normaliser, learner_version=0)
    return time.perf_counter() - started, result.metrics["loss"]


def compare(
    model: torch.nn.Module,
    seqs: list[TrainSequence],
    ways: dict[str, list[MicroBatch]],
    budget: int,
    repeats: int,
) -> dict[str, Any]:
    """Time one train_step per way per repeat (alternating order) after checking the ways agree on the loss."""
    config = LearnerConfig(micro_batch_tokens=budget)
    normaliser = float(step_loss_units(seqs, config.loss.aggregation))
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)
    losses = {name: _timed_step(model, frozen, mbs, config, normaliser)[1] for name, mbs in ways.items()}
    if max(losses.values()) - min(losses.values()) > 1e-5:
        raise SystemExit(f"{' and '.join(ways)} disagree on the loss: {losses}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        for name in order:
            seconds[name].append(_timed_step(model, optimizer, ways[name], config, normaliser)[0])

    real = sum(s.length for s in seqs)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    lengths = sorted(s.length for s in seqs)
    return {
        "real_tokens": real,
        "lengths": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
        "micro_batches": {name: len(mbs) for name, mbs in ways.items()},
        "forward_tokens": {name: sum(mb.num_tokens for mb in mbs) for name, mbs in ways.items()},
        "padded_tokens": {name: sum(mb.padded_tokens for mb in mbs) for name, mbs in ways.items()},
        "seconds": seconds,
        "median_seconds": median,
        "tokens_per_s": {name: real / median[name] for name in ways},
        "loss": losses,
        "policy_loss": config.loss.policy_loss,
        "aggregation": config.loss.aggregation,
    }


def run(mode: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    p = MODES[mode]
    model = AutoModelForCausalLM.from_pretrained(
        init_tiny_model(), dtype=torch.float32, attn_implementation=register_packed_attention()
    )
    vocab = model.config.vocab_size
    seqs = long_tailed_batch(p["sequences"], p["long_fraction"], vocab)
    ways = {
        "packing": packed_micro_batches(seqs, p["budget"]),
        "padding": padded_micro_batches(seqs, p["budget"]),
    }
    results = compare(model, seqs, ways, p["budget"], p["repeats"])
    grpo = grpo_batch(p["groups"], vocab)
    grpo_ways = {
        "shared": grpo_micro_batches(grpo, GRPO_BUDGET, share=True),
        "unshared": grpo_micro_batches(grpo, GRPO_BUDGET, share=False),
    }
    results["grpo"] = compare(model, grpo, grpo_ways, GRPO_BUDGET, p["repeats"])
    tps, grpo_tps = results["tokens_per_s"], results["grpo"]["tokens_per_s"]
    headline = {
        "tokens_per_s": tps["packing"],
        "tokens_per_s_padding": tps["padding"],
        "ratio_packing_vs_padding": tps["packing"] / tps["padding"],
        "grpo_tokens_per_s_shared": grpo_tps["shared"],
        "grpo_tokens_per_s_unshared": grpo_tps["unshared"],
        "ratio_shared_vs_unshared": grpo_tps["shared"] / grpo_tps["unshared"],
    }
    params = {**p, "model": "tiny-qwen2 (hidden 128, 4 layers)", "dtype": "float32", "torch_threads": 1}
    params.update(group_size=GROUP_SIZE, grpo_budget=GRPO_BUDGET)
    params["loss"] = results["policy_loss"]
    params["aggregation"] = results["aggregation"]
    return params, results, headline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_flags(parser, "smaller batch, fewer repeats (under a minute)")
    parser.add_argument("--out", type=Path, default=Path("runs/learner_throughput.json"), help="result JSON")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    params, results, headline = run(mode)
    doc = write_result(args.out, "learner_throughput", mode, params, results, TARGETS, headline)
    rows = [
        [name, results["micro_batches"][name], results["padded_tokens"][name], results["median_seconds"][name],
         results["tokens_per_s"][name]]
        for name in ("packing", "padding")
    ]  # fmt: skip
    grpo = results["grpo"]
    rows += [
        [f"grpo {name}", grpo["micro_batches"][name], grpo["padded_tokens"][name], grpo["median_seconds"][name],
         grpo["tokens_per_s"][name]]
        for name in ("shared", "unshared")
    ]  # fmt: skip
    print(format_table(["way", "micro-batches", "padded tokens", "seconds", "tokens/s"], rows))
    print(
        f"ratio_packing_vs_padding {doc['ratio_packing_vs_padding']:.2f} (target >= 2), "
        f"ratio_shared_vs_unshared {doc['ratio_shared_vs_unshared']:.2f} (target >= 1.2), passed={doc['passed']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
