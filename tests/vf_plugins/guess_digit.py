"""A multi-turn guess-the-digit environment built with verifiers' own classes (v1 API), for the verifiers
adapter's tests; it runs in the verifiers virtualenv (`.venv-verifiers`, see the Makefile).

This module is a verifiers plugin: as the taskset id ``guess_digit`` (verifiers imports a plugin id as a
top-level module, so the tests put ``tests/vf_plugins`` on PYTHONPATH) it exports its Taskset, the
Env that plays it (the default for the taskset) and the Harness its agent runs (the taskset's default):

- GuessTaskset: task i asks for the digit ``guess_game.target_of(i)``; the rubric (``@vf.reward game``)
  replays the trace's assistant messages through the game's rules.
- GuessEnv: ``run()`` holds one interaction open with its ``player`` agent and answers each reply with
  "higher" / "lower" / "no digit" as a user turn, until the guess is right or MAX_STEPS guesses were made.
- ChatHarness: an in-process chat loop, one model call per segment through the interception endpoint with
  the ``openai`` SDK (what verifiers' ``null`` harness does, without its uv-installed program: this machine and
  CI have no network for ``uv sync``). With ``rewrite_history`` it edits its earlier replies before each call,
  as a compacting harness would, so the adapter must refuse the conversation; with ``calculator`` it declares
  its own ``calc`` tool and runs the model's calls to it (the tool-using case).
"""

from __future__ import annotations

import json

import openai
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from rollout_fleet.envs.tools import ToolCallError, calculate
from tests.guess_game import FIRST, MAX_STEPS, answer, replay, target_of

__all__ = ["ChatHarness", "GuessEnv", "GuessTaskset"]
TASKS = 64


class GuessData(vf.TaskData):
    target: int = 0


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def game(self, task: GuessData, trace: vf.Trace) -> float:
        """The game's total reward over the guesses the trace holds (replies that call a tool are not guesses)."""
        guesses = [m.content or "" for m in trace.assistant_messages if not m.tool_calls]
        return replay(task.target, guesses)[1]


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for i in range(TASKS):
            yield GuessTask(GuessData(prompt=FIRST, target=target_of(i)), self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    rewrite_history: bool = False
    calculator: bool = False  # offer the model the harness's own `calc` tool


CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate integer arithmetic (+ - * // %).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def run_calc(arguments: str) -> str:
    try:
        return calculate(str(json.loads(arguments).get("expression", "")))
    except (ToolCallError, ValueError, AttributeError) as exc:
        return f"error: {exc}"


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        """One segment: model calls until a reply calls no tool (the harness runs its `calc` tool itself)."""
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        if self.config.rewrite_history:
            messages = [{**m, "content": "(compacted)"} if m["role"] == "assistant" else m for m in messages]
        tools = [CALC] if self.config.calculator else openai.NOT_GIVEN
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            while True:
                completion = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=tools
                )
                reply = completion.choices[0].message
                if not reply.tool_calls:
                    break
                messages.append(reply.model_dump(exclude_none=True))
                for call in reply.tool_calls:
                    result = run_calc(call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"})


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents) -> None:
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            for step in range(1, MAX_STEPS + 1):
                if segment.terminated:
                    return
                message, _, done = answer(task.data.target, segment.last_reply, step)
                if done:
                    return
                segment = await chat.turn(message)
