"""The built-in multi-turn task: multiplication with a calculator tool, where the larger problems need the tool.

A one-digit product is answered directly (``#56``); a product of two- and three-digit numbers is beyond what
the tiny model computes reliably, so it calls the calculator and copies the result:

    <|im_start|>user\\n123*45=<|im_end|>\\n<|im_start|>assistant\\n      (prompt)
    <calc>123*45</calc><|im_end|>                                       (turn 1: a tool call; trained)
    \\n<|im_start|>tool\\n5535<|im_end|>\\n<|im_start|>assistant\\n       (observation; masked)
    #5535<|im_end|>                                                     (turn 2: the answer; trained)

Rewards: ``correct`` (the text after the last ``#`` of the last turn is exactly the product's digits) and ``format`` (the last
turn is ``#<digits>``). Prompts are a pure function of (seed, split, index); the problem space is split by a
hash of the unordered pair, as in the addition task, so no held-out problem is trained on.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any, Literal

from pydantic import Field

from rollout_fleet.envs.base import Environment, EnvironmentTask, StepResult
from rollout_fleet.envs.tools import ToolCallError, parse_tool_call, run_tool, tool_observation
from rollout_fleet.tasks.base import (
    TEST,
    TRAIN,
    GeneratedTaskOptions,
    Prompt,
    RewardResult,
    TaskError,
    strip_special,
)

# (digits of a, digits of b) and their weights: the one-digit table is answered directly, the rest needs the tool
SHAPES = ((1, 1), (2, 1), (2, 2), (3, 2))
SHAPE_WEIGHTS = (40, 20, 25, 15)
NEEDS_TOOL = frozenset({(2, 2), (3, 2)})
HELDOUT_SHARE = 4
MAX_ATTEMPTS = 1000
_ANSWER_RE = re.compile(r"#(\d+)")


class ToolArithmeticConfig(GeneratedTaskOptions):
    """tool_arithmetic: multiplication with a calculator tool (multi-turn)."""

    name: Literal["tool_arithmetic"] = Field("tool_arithmetic", description="The task.")


def _heldout(seed: int, a: int, b: int) -> bool:
    lo, hi = min(a, b), max(a, b)
    digest = hashlib.sha256(f"tool_arithmetic:{seed}:{lo}*{hi}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_SHARE == 0


def last_turn(completion: str) -> str:
    """The text of the last model turn of a transcript (after the last assistant header)."""
    return strip_special(completion.rsplit("<|im_start|>assistant\n", 1)[-1])


class ToolArithmeticEnv(Environment):
    """One episode: a ``<calc>`` call gets the calculator's answer as a tool message; any other turn ends it."""

    def __init__(self, prompt: Prompt, tokenizer: Any, sandbox: Any = None) -> None:
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.sandbox = sandbox  # the python tool's SandboxConfig; None: only calc

    async def reset(self) -> str:
        return self.prompt.text

    async def step(self, action: str) -> StepResult:
        try:
            call = parse_tool_call(action, "tags")
        except ToolCallError as exc:
            content, status, tool = f"error: {exc}", "error", "unknown"
        else:
            if call is None:
                return StepResult(done=True)
            content, status = await run_tool(call, self.sandbox)
            tool = call.name
        observation = tool_observation(self.tokenizer, content)
        return StepResult(
            observation=observation, info={"tool": tool, "tool_status": status, "result": content}
        )


class ToolArithmeticTask(EnvironmentTask):
    """Products of a one- to three-digit and a one- or two-digit number, with a calculator tool."""

    name = "tool_arithmetic"
    version = "1"
    uses_sandbox = True  # <python> calls run in rollout.sandbox
    Config = ToolArithmeticConfig

    def __init__(
        self, config: ToolArithmeticConfig | None = None, /, tokenizer: Any = None, **options: Any
    ) -> None:
        c = self.configure(config, options)
        self.seed, self.train_size, self.heldout_size = c.seed, c.train_size, c.heldout_size
        self.format_weight = c.format_weight
        self.tokenizer = tokenizer

    def num_prompts(self, split: str = TRAIN) -> int:
        self._check_request(0, split)
        return self.train_size if split == TRAIN else self.heldout_size

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        self._check_request(index, split)
        if split == TEST and index >= self.heldout_size:
            raise TaskError(
                f"task tool_arithmetic: test index {index} out of range (heldout_size {self.heldout_size})"
            )
        return self._prompt(split, index)

    def _prompt(self, stream: str, index: int) -> Prompt:
        rng = random.Random(f"tool_arithmetic:{self.seed}:{stream}:{index}")
        shape = rng.choices(SHAPES, SHAPE_WEIGHTS)[0]
        for _ in range(MAX_ATTEMPTS):
            a, b = (rng.randrange(0 if d == 1 else 10 ** (d - 1), 10**d) for d in shape)
            if _heldout(self.seed, a, b) == (stream != TRAIN):
                break
        else:
            raise TaskError(f"task tool_arithmetic: no {stream} problem found at index {index}")
        text = f"<|im_start|>user\n{a}*{b}=<|im_end|>\n<|im_start|>assistant\n"
        return Prompt(
            prompt_id=f"tool_arithmetic/{self.seed}/{stream}/{index}",
            text=text,
            answer=str(a * b),
            split=stream if stream in (TRAIN, TEST) else TEST,
            index=index,
            metadata={"a": a, "b": b, "needs_tool": shape in NEEDS_TOOL},
        )

    def validation_prompt(self, index: int) -> Prompt:
        """A held-out-space prompt from a stream separate from the test split's (the warm start's stopping rule)."""
        return self._prompt("validation", index)

    def difficulty(self, prompt: Prompt) -> str | None:
        return "needs_tool" if prompt.metadata.get("needs_tool") else "direct"

    def make_env(self, prompt: Prompt) -> Environment:
        if self.tokenizer is None:
            raise TaskError(
                "task tool_arithmetic: make_env needs the tokenizer (the tool message is templated)"
            )
        return ToolArithmeticEnv(prompt, self.tokenizer, self.sandbox)

    def reference_turns(self, prompt: Prompt, use_tool: bool | None = None) -> list[str]:
        """The model turns of the reference episode (each ending with its ``<|im_end|>``): the tool call and the
        answer when the problem needs the tool (or ``use_tool``), else the answer alone."""
        a, b = prompt.metadata["a"], prompt.metadata["b"]
        tool = prompt.metadata["needs_tool"] if use_tool is None else use_tool
        answer = f"#{a * b}<|im_end|>"
        return [f"<calc>{a}*{b}</calc><|im_end|>", answer] if tool else [answer]

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        final = last_turn(completion)
        m = _ANSWER_RE.fullmatch(final)
        fmt = 1.0 if m else 0.0
        got = final.rsplit("#", 1)[1].strip() if "#" in final else None
        correct = 1.0 if got is not None and got.isascii() and got == prompt.answer else 0.0  # exact digits
        return RewardResult(
            reward=correct + self.format_weight * fmt, components={"correct": correct, "format": fmt}
        )
