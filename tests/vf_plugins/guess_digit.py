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
  as a compacting harness would, so the adapter must refuse the conversation.
"""

from __future__ import annotations

import openai
import verifiers.v1 as vf

from tests.guess_game import FIRST, MAX_STEPS, answer, replay, target_of

__all__ = ["ChatHarness", "GuessEnv", "GuessTaskset"]
TASKS = 64


class GuessData(vf.TaskData):
    target: int = 0


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def game(self, task: GuessData, trace: vf.Trace) -> float:
        """The game's total reward over the guesses the trace holds."""
        return replay(task.target, [m.content or "" for m in trace.assistant_messages])[1]


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for i in range(TASKS):
            yield GuessTask(GuessData(prompt=FIRST, target=target_of(i)), self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    rewrite_history: bool = False


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        if self.config.rewrite_history:
            messages = [{**m, "content": "(compacted)"} if m["role"] == "assistant" else m for m in messages]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
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
