"""Held-out evaluation: greedy and sampled (T = 1) accuracy of a model on a task's test split.

Plain torch + transformers on CPU (or wherever the model lives): prompts are left-padded into one batch,
prefilled once, then decoded one token per step with the KV cache; a sequence stops at EOS. The warm starts
and the TRL comparison (``benchmarks/vs_trl``) measure with it; ``summary.json``'s numbers come from the
evaluator instead (``rollout_fleet.evaluator``: the engines serve the policy, scored by the training reward),
but both count accuracy the same way, :func:`rollout_fleet.eval_stats.accuracy` (correctness only, whatever
the task's RL reward adds for format). Here the task's own verifier scores.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rollout_fleet.eval_stats import accuracy, format_rate
from rollout_fleet.tasks import TEST, Prompt, Task, get_task

DEFAULT_MAX_NEW_TOKENS = 96  # the longest arithmetic completion is 90 characters + EOS


@torch.inference_mode()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 256,
) -> list[list[int]]:
    """Generated token ids per prompt (up to and excluding EOS); temperature 0 is greedy.

    Finished rows leave the batch (and the KV cache) once a quarter of it is done, so the long tail of a few
    8-digit problems does not drag 200 rows through every decode step.

    Sampling draws from softmax(logits / temperature) with a generator seeded by ``seed``, so results are
    reproducible for a given batch layout.
    """
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return generate_ids(model, tokenizer, encoded, max_new_tokens, temperature, seed, batch_size)


@torch.inference_mode()
def generate_ids(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 256,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """:func:`generate` from token ids; a row also stops at any of ``stop_token_ids``, which (unlike EOS) stays
    in its output, as an engine's stop token does (a multi-turn episode's end-of-turn marker)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    out: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start : start + batch_size]
        out.extend(
            _generate_batch(model, tokenizer, chunk, max_new_tokens, temperature, generator, stop_token_ids)
        )
    return out


def _generate_batch(
    model: Any,
    tokenizer: Any,
    encoded: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    device = next(model.parameters()).device
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    stops = torch.tensor(sorted({eos, *stop_token_ids}), device=device)
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=device)  # (B, L)
    mask = torch.tensor(
        [[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device
    )  # (B, L)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L): left padding must not shift positions
    cache_arg = _cache_argument(model)
    result = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, logits = _cache_of(result), result.logits[:, -1]
    next_pos = positions[:, -1:] + 1  # (A, 1) for the A rows still in the batch
    rows = list(range(len(encoded)))  # original prompt of each row in the batch
    outputs: list[list[int]] = [[] for _ in encoded]
    done = torch.zeros(len(encoded), dtype=torch.bool, device=device)  # (A,) emitted EOS, awaiting removal
    for _ in range(max_new_tokens):
        token = _pick(logits.float(), temperature, generator).to(device)  # (A,)
        token = torch.where(done, torch.full_like(token, pad), token)
        for row, (tok, finished) in enumerate(zip(token.tolist(), done.tolist(), strict=True)):
            if not finished:
                outputs[rows[row]].append(tok)
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
        if int(done.sum()) * 4 >= len(rows):  # drop finished rows (cache included) once a quarter is done
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            token, mask, next_pos, done = token[keep], mask[keep], next_pos[keep], done[keep]
            rows = [rows[i] for i in keep.tolist()]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        result = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_arg: cache},
        )
        cache, logits, next_pos = _cache_of(result), result.logits[:, -1], next_pos + 1
    return [out[: out.index(eos)] if eos in out else out for out in outputs]


def _cache_argument(model: Any) -> str:
    """transformers 5 calls the KV cache argument ``cache``; 4.x called it ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(result: Any) -> Any:
    cache = getattr(result, "cache", None)
    return cache if cache is not None else result.past_key_values


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids: argmax below 1e-6, else a sample at ``temperature``."""
    if temperature < 1e-6:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def load_model(path: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) from a Hugging Face model directory, fp32 on CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    from rollout_fleet.model import load_tokenizer

    return model.eval(), load_tokenizer(path)


def evaluate(
    model: Any,
    tokenizer: Any = None,
    task: Task | None = None,
    n: int | None = None,
    split: str = TEST,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    seed: int = 0,
    batch_size: int = 256,
) -> dict[str, float | int]:
    """Accuracy of ``model`` (a model directory or an in-memory causal LM plus its tokenizer) on ``split``.

    Returns greedy_accuracy, sampled_accuracy (one sample per prompt at T = 1), format_rate (greedy) and
    sampled_format_rate (fractions of prompts), and n. Accuracy is :func:`rollout_fleet.eval_stats.accuracy`.
    """
    if isinstance(model, str | Path):
        model, loaded = load_model(model)
        tokenizer = tokenizer or loaded
    if tokenizer is None:
        raise ValueError("evaluate: an in-memory model needs its tokenizer")
    task = task or get_task("arithmetic")
    count = task.num_prompts(split) if n is None else min(n, task.num_prompts(split))
    prompts = [task.make_prompt(i, split) for i in range(count)]
    was_training = model.training
    model.eval()
    try:
        greedy = _score(model, tokenizer, task, prompts, 0.0, seed, max_new_tokens, batch_size)
        sampled = _score(model, tokenizer, task, prompts, 1.0, seed, max_new_tokens, batch_size)
    finally:
        model.train(was_training)
    return {
        "greedy_accuracy": greedy[0],
        "sampled_accuracy": sampled[0],
        "format_rate": greedy[1],
        "sampled_format_rate": sampled[1],
        "n": count,
    }


def _score(
    model: Any,
    tokenizer: Any,
    task: Task,
    prompts: list[Prompt],
    temperature: float,
    seed: int,
    max_new_tokens: int,
    batch_size: int,
) -> tuple[float, float]:
    """(accuracy, format rate) of one generation pass."""
    outputs = generate(
        model, tokenizer, [p.text for p in prompts], max_new_tokens, temperature, seed, batch_size
    )
    results = [task.score(p, tokenizer.decode(ids)) for p, ids in zip(prompts, outputs, strict=True)]
    return accuracy(results), format_rate(results)
