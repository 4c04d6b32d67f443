"""Tool calls in model output, the built-in tools, and how their results go back as observations.

Two call formats:

- ``tags`` (the tiny model's): ``<calc>12*34</calc>`` or ``<python>print(1)</python>``; the tag is the tool.
- ``hermes`` (the chat templates of Qwen2.5 / Hermes-style tokenizers that declare tools):
  ``<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>``.

The result goes back as one chat message of role ``tool`` rendered by the tokenizer's own chat template
(:func:`tool_observation`), followed by the next assistant header, so the model sees what it was trained on.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_fleet.sandbox import SandboxConfig

TOOL_FORMATS = ("tags", "hermes")
_TAG_RE = re.compile(r"<(calc|python)>(.*?)</\1>", re.DOTALL)
_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALC_MAX_DIGITS = 64  # a result (or operand) longer than this is an error, not a 10**10**10 computation
_SENTINEL = "\u241eassistant-text\u241e"  # stands for a model turn when rendering the template around it


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its argument text (a calc expression, python code)."""

    name: str
    argument: str


class ToolCallError(ValueError):
    """A call the model wrote that cannot be parsed (bad JSON, a missing argument): shown to the model."""


def parse_tool_call(text: str, fmt: str) -> ToolCall | None:
    """The first tool call in one turn's text, None when the turn calls no tool; ToolCallError for a malformed
    call (the model's mistake, answered as a tool error)."""
    if fmt == "tags":
        m = _TAG_RE.search(text)
        return None if m is None else ToolCall(m.group(1), m.group(2))
    if fmt == "hermes":
        m = _HERMES_RE.search(text)
        if m is None:
            return None
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"tool call is not JSON: {exc.msg}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallError('tool call must be {"name": ..., "arguments": {...}}')
        args = call.get("arguments", {})
        if isinstance(args, str):
            return ToolCall(call["name"], args)
        if not isinstance(args, dict):
            raise ToolCallError("tool call arguments must be an object")
        key = {"python": "code", "calc": "expression"}.get(call["name"], "")
        value = args.get(key, next(iter(args.values()), "")) if args else ""
        return ToolCall(call["name"], str(value))
    raise ValueError(f"unknown tool format {fmt!r}; expected one of {TOOL_FORMATS}")


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> str:
    """The value of an integer expression of + - * // % and parentheses, as decimal text; raises ToolCallError
    for anything else (names, calls, powers, huge numbers). Pure Python on a parsed tree: no eval, no code."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolCallError(f"calc: cannot parse {expression.strip()[:40]!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolCallError("calc: division by zero")
            result = _BINARY[type(node.op)](left, right)
            if len(str(abs(result))) > CALC_MAX_DIGITS:
                raise ToolCallError(f"calc: result longer than {CALC_MAX_DIGITS} digits")
            return result
        raise ToolCallError(f"calc: only integers and + - * // % are allowed, not {type(node).__name__}")

    return str(value(tree.body))


def tool_observation(tokenizer: Any, content: str, role: str = "tool") -> str:
    """The text that follows a model turn ending with its end-of-turn token: the rest of that turn's template
    suffix, one ``role`` message with ``content``, and the next assistant header (see :func:`chat_observation`)."""
    return chat_observation(tokenizer, [{"role": role, "content": content}])


def chat_observation(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    """The text that follows a model turn ending with its end-of-turn token: the rest of that turn's template
    suffix, ``messages`` (chat messages as dicts: tool results, a user turn) and the next assistant header, all
    rendered by the tokenizer's chat template (the difference between two renderings, so a template's default
    system prompt is not repeated; ``tools`` go to both renderings, so a tools system block cancels out)."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    extra = {"tools": tools} if tools else {}
    before = tokenizer.apply_chat_template(base, tokenize=False, **extra)
    after = tokenizer.apply_chat_template(
        [*base, *messages], tokenize=False, add_generation_prompt=True, **extra
    )
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders a conversation's prefix differently; cannot append a tool turn"
        )
    tail = before[
        before.rindex(_SENTINEL) + len(_SENTINEL) :
    ]  # what follows the assistant text: the end-of-turn marker and more
    end_marker = tail.lstrip().split("\n", 1)[0]  # the model generated the marker itself (its stop token)
    suffix = tail[tail.index(end_marker) + len(end_marker) :] if end_marker else tail
    return suffix + after[len(before) :]


async def run_tool(call: ToolCall, sandbox: SandboxConfig | None) -> tuple[str, str]:
    """(observation content, status) of one call: ``calc`` in-process on a parsed tree, ``python`` in a fresh
    sandbox process (rollout_fleet.sandbox; never in this process). A tool error (bad expression, an exception,
    a limit hit) is the status's kind and shown to the model; an unusable sandbox raises SandboxError, which
    is an infrastructure failure the model is never shown."""
    if call.name == "calc":
        try:
            return calculate(call.argument), "ok"
        except ToolCallError as exc:
            return f"error: {exc}", "error"
    if call.name == "python":
        if sandbox is None:
            return "error: the python tool is not enabled for this task", "error"
        from rollout_fleet.sandbox import run_python

        result = await run_python(call.argument, sandbox)
        return result.observation().rstrip("\n"), result.kind
    return f"error: unknown tool {call.name!r}", "error"
