"""Synthetic prompt groups sampled from a real HF model, for tests of the learner without engines.

Outputs are sampled at temperature 1 with the model's own log-probs as behaviour log-probs (what an engine on
the same weights returns), and a toy verifiable reward (1 when the output contains a digit '7'), so groups
have signal and staleness 0 means ratio 1.
"""

from __future__ import annotations

import numpy as np
import torch

from broker.record import Sample, TrajectoryGroup


def sample_groups(
    model_dir: str,
    n_groups: int,
    group_size: int,
    version: int,
    run_id: str = "test",
    start_index: int = 0,
    max_new_tokens: int = 12,
    seed: int = 0,
) -> list[TrajectoryGroup]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    groups = []
    for g in range(n_groups):
        index = start_index + g
        prompt = tok(f"{index}+{index * 3}=", add_special_tokens=False).input_ids
        samples = []
        for i in range(group_size):
            ids, lps = _sample(model, prompt, max_new_tokens)
            text = tok.decode(ids)
            samples.append(
                Sample(
                    sample_index=i,
                    output_ids=np.array(ids, dtype=np.int32),
                    logprobs=np.array(lps, dtype=np.float32),
                    versions=np.full(len(ids), version, dtype=np.int32),
                    loss_mask=np.ones(len(ids), dtype=np.uint8),
                    finish_reason="length",
                    truncated=True,
                    reward=float("7" in text),
                    reward_components={"correct": float("7" in text)},
                )
            )
        groups.append(
            TrajectoryGroup(
                run_id=run_id,
                epoch=0,
                prompt_index=index,
                attempt=0,
                prompt_id=f"p{index}",
                task="synthetic",
                prompt_ids=np.array(prompt, dtype=np.int32),
                samples=samples,
            )  # fmt: skip
        )
    return groups


@torch.no_grad()
def _sample(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    ids = list(prompt)
    out, lps = [], []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logp = torch.log_softmax(logits, -1)
        token = int(torch.multinomial(logp.exp(), 1))
        out.append(token)
        lps.append(float(logp[token]))
        ids.append(token)
    return out, lps
