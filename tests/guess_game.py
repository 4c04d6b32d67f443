"""The guess-the-digit game's rules, shared by the verifiers test environment (tests/verifiers_guess.py, which
runs in the verifiers virtualenv) and the test that replays records against them (in the main one)."""

from __future__ import annotations

import hashlib

MAX_STEPS = 3
WRONG = -0.125  # a wrong guess's reward: nonzero, so every episode's reward shows
FIRST = "Guess a digit from 0 to 9."


def target_of(index: int) -> int:
    """Task ``index``'s digit (deterministic: every sample of a group plays the same game)."""
    return hashlib.sha256(f"guess:{index}".encode()).digest()[0] % 10


def answer(target: int, text: str, step: int) -> tuple[str, float, bool]:
    """(message, reward, done) of guess number ``step``: the first digit in text is the guess."""
    digit = next((int(c) for c in text if c.isdigit()), None)
    if digit == target:
        return "right", 1.0, True
    message = "no digit" if digit is None else ("higher" if target > digit else "lower")
    return message, WRONG, step >= MAX_STEPS


def replay(target: int, guesses: list[str]) -> tuple[list[str], float]:
    """The environment's messages after each guess until the game ends, and the game's total reward."""
    messages, total = [], 0.0
    for step, text in enumerate(guesses, start=1):
        message, reward, done = answer(target, text, step)
        total += reward
        if done:
            break
        messages.append(message)
    return messages, total
