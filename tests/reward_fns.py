"""Reward functions for tests/test_rewards.py, loaded by import path inside reward worker processes."""

from __future__ import annotations

import math
import os
import time

from rollout_fleet.tasks import Prompt, RewardResult


def length_reward(prompt: Prompt, completion: str, scale: float = 1.0) -> dict[str, float]:
    """A reward with components and an option: reward = scale * [completion ends with the answer]."""
    hit = float(completion.endswith(prompt.answer))
    return {"reward": scale * hit, "hit": hit, "length": float(len(completion))}


def as_result(prompt: Prompt, completion: str) -> RewardResult:
    return RewardResult(reward=0.25, components={"partial": 0.25})


def hang(prompt: Prompt, completion: str) -> float:
    time.sleep(3600)
    return 1.0


def boom(prompt: Prompt, completion: str) -> float:
    raise RuntimeError(f"verifier exploded on {prompt.prompt_id}")


def nan_reward(prompt: Prompt, completion: str) -> float:
    return math.nan


def inf_component(prompt: Prompt, completion: str) -> dict[str, float]:
    return {"reward": 1.0, "bonus": math.inf}


def not_a_number(prompt: Prompt, completion: str) -> str:
    return "high"


def die(prompt: Prompt, completion: str) -> float:
    os._exit(3)


def pid(prompt: Prompt, completion: str) -> float:
    return float(os.getpid())


def torch_threads(prompt: Prompt, completion: str) -> float:
    """Importing torch inside the scorer: the worker must then limit torch to one thread."""
    import torch

    return float(torch.get_num_threads())


NOT_CALLABLE = 42


def memory_hog(prompt: Prompt, completion: str) -> float:
    """Allocates 2 GiB: past a reward worker's RLIMIT_AS."""
    block = bytearray(2 << 30)
    return float(len(block))


def length_echo(
    prompt: Prompt, completion: str, truncated: bool, output_tokens: int, max_output_tokens: int
) -> dict[str, float]:
    """Asks for the sample's length by name: echoes it as components (reward 1)."""
    return {
        "reward": 1.0,
        "truncated": float(truncated),
        "output_tokens": float(output_tokens),
        "max_output_tokens": float(max_output_tokens),
    }


def length_kwargs(prompt: Prompt, completion: str, **info: object) -> dict[str, float]:
    """Takes ``**kwargs``: gets every length argument (their count is its reward)."""
    return {"reward": float(len(info)), "budget": float(info["max_output_tokens"])}  # type: ignore[arg-type]
