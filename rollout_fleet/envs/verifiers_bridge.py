"""The verifiers side of the ``verifiers`` adapter: imported only where verifiers is installed (the
``verifiers`` extra; see :mod:`rollout_fleet.envs.verifiers_env` for the streamrl side and the design).

verifiers (v1 API, 0.4.0) owns the control flow of an episode: ``Env.run_episode`` runs the env's ``run()``,
whose agents run a harness program that calls a model through verifiers' interception server, which hands each
call to a :class:`verifiers.v1.Client`. streamrl owns generation (token-in / token-out with the engine). The
bridge inverts the call: :class:`BridgeClient` is that Client, and its ``get_response`` does not call a model; it
puts the conversation on the episode's :class:`Channel` and waits for streamrl's episode loop to answer with the
model's turn. So verifiers' rollout runs unchanged (harness, hooks, ``@stop``s, scoring) while streamrl
generates and trains on the engine's own ids.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import ProviderError
from verifiers.v1.interception import InterceptionServer

# The ModelContext every bridged rollout runs under. Its client config is a sentinel: nothing is ever sent to
# this URL; the interception server finds the BridgeClient registered under this config's JSON instead.
MODEL = "streamrl-policy"
BRIDGE_CLIENT = vf.EvalClientConfig(
    base_url="http://streamrl-bridge.invalid/v1", api_key_var="STREAMRL_BRIDGE"
)
CONTEXT = vf.ModelContext(model=MODEL, client=BRIDGE_CLIENT)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)  # Hermes / Qwen2.5 tool calls


@dataclass
class ModelCall:
    """One model call of the verifiers rollout, waiting for streamrl's answer (the turn's text)."""

    messages: list[dict[str, Any]]  # the whole conversation as chat wire dicts
    tools: list[dict[str, Any]] | None
    answer: asyncio.Future[str]
    reply: dict[str, Any] | None = None  # the assistant message returned to verifiers, as a chat wire dict


@dataclass
class Finished:
    """The verifiers rollout returned: its episode (traces, rewards, errors)."""

    episode: Any


@dataclass
class Channel:
    """One streamrl episode's link to one verifiers rollout: model calls and the end come out of ``events``."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    trace_ids: list[str] = field(default_factory=list)
    policy_trace: str | None = None  # the trace whose model calls streamrl answers
    runner: asyncio.Task | None = None


class BridgeClient(vf.Client):
    """The verifiers Client of every bridged rollout: routes each call by trace id to its episode's channel."""

    def __init__(self) -> None:
        self.routes: dict[str, Channel] = {}

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> vf.Response:
        """Hand the call to its episode and return the episode's answer as the assistant message (verifiers'
        sampling config is ignored: the worker samples)."""
        channel = self._channel(dialect, session_id)
        request = dialect.parse_request(body)
        call = ModelCall(
            [message_to_wire(m) for m in request.messages],
            [tool_to_wire(t) for t in request.tools] if request.tools else None,
            asyncio.get_running_loop().create_future(),
        )
        channel.events.put_nowait(call)
        response = completion(await call.answer, f"streamrl-{session_id}-{len(request.messages)}", call.tools)
        call.reply = message_to_wire(response.message)
        return response

    def _channel(self, dialect: Any, session_id: str | None) -> Channel:
        """The episode that answers this trace's calls; ProviderError (a 400 to the harness, the rollout's
        error) for what the bridge cannot carry."""
        channel = self.routes.get(session_id or "")
        if channel is None:
            raise ProviderError(f"streamrl bridge: no episode for trace {session_id!r}", status_code=400)
        if channel.policy_trace not in (None, session_id):
            # a second agent of the episode calls the policy: its turns are not part of the one token sequence
            raise ProviderError(
                "streamrl bridge: a second agent of this episode called the policy model; multi-agent episodes "
                "are not supported (pin the other agents' client/model in the verifiers env config)",
                status_code=400,
            )
        if not isinstance(dialect, ChatDialect):
            raise ProviderError(
                f"streamrl bridge: only the chat-completions dialect is bridged, not {type(dialect).__name__}",
                status_code=400,
            )
        channel.policy_trace = session_id
        return channel


def completion(text: str, response_id: str, tools: list[dict[str, Any]] | None = None) -> vf.Response:
    """The episode's turn as verifiers' Response, with the OpenAI completion the harness's SDK receives. When
    the call declared tools, the turn's Hermes-style ``<tool_call>{"name", "arguments"}</tool_call>`` blocks
    become its tool calls (a block that is not such JSON stays text: the model's mistake, shown as written)."""
    content, calls = split_tool_calls(text) if tools else (text, [])
    response = vf.Response(
        id=response_id,
        created=0,
        model=MODEL,
        message=vf.AssistantMessage(
            content=content if content or not calls else None, tool_calls=calls or None
        ),
        finish_reason="tool_calls" if calls else "stop",
    )
    response.raw = serialize_completion(response, MODEL)
    return response


def split_tool_calls(text: str) -> tuple[str, list[vf.ToolCall]]:
    """(the text without its well-formed tool-call blocks, those calls)."""
    calls: list[vf.ToolCall] = []

    def take(match: re.Match) -> str:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match.group(0)
        args = call.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(vf.ToolCall(id=f"call_{len(calls)}", name=call["name"], arguments=arguments))
        return ""

    content = _TOOL_CALL.sub(take, text).strip()
    return (content, calls) if calls else (text, [])


class Runner:
    """A loaded verifiers Env served on one event loop (its shared tools and one interception server whose
    model client is the :class:`BridgeClient`), starting one verifiers rollout per streamrl episode."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.client = BridgeClient()
        self._serving: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None

    async def serve(self) -> None:
        """Serve the env on this event loop (a worker has one; tests have one per test), once."""
        loop = asyncio.get_running_loop()
        if self._serving is None or self._serving.get_loop() is not loop or self._serving.done():
            self._ready = loop.create_future()
            self._serving = loop.create_task(self._hold(self._ready))
        assert self._ready is not None
        await asyncio.shield(self._ready)

    async def _hold(self, ready: asyncio.Future) -> None:
        """``env.serving()`` held open by a task of its own until the loop ends (its cancellation unwinds the
        context properly, which an exit stack left open at loop shutdown would not)."""
        try:
            async with self.env.serving():
                interception = getattr(self.env, "_interception", None)
                if not isinstance(interception, InterceptionServer):
                    raise RuntimeError(
                        "the verifiers env is not served by one InterceptionServer (env.interception.type must "
                        f"be 'server'; got {type(interception).__name__}); the adapter is tested with 0.4.0"
                    )
                # InterceptionServer._client looks its clients up by config JSON before building one:
                # registering the bridge under the sentinel config routes every unpinned agent's calls here.
                interception.clients[BRIDGE_CLIENT.model_dump_json()] = self.client
                ready.set_result(None)
                await asyncio.Event().wait()
        except Exception as exc:  # noqa: BLE001 - handed to whoever waits for the env to be served
            if not ready.done():
                ready.set_exception(exc)
            else:
                raise

    async def start(self, task: Any) -> Channel:
        """Start one rollout of the verifiers ``task``; its model calls and its end arrive on the channel."""
        await self.serve()
        channel = Channel()

        def claim(trace: Any) -> None:
            channel.trace_ids.append(trace.id)
            self.client.routes[trace.id] = channel

        async def run() -> None:
            try:
                episode = await self.env.run_episode(task, CONTEXT, on_trace=claim)
            except Exception as exc:  # noqa: BLE001 - handed to the episode, which reports it
                channel.events.put_nowait(exc)
            else:
                channel.events.put_nowait(Finished(episode))

        channel.runner = asyncio.get_running_loop().create_task(run())
        return channel

    async def stop(self, channel: Channel) -> None:
        """Cancel the rollout if it still runs (streamrl ended the episode: EOS, a budget, a drop)."""
        for trace_id in channel.trace_ids:
            self.client.routes.pop(trace_id, None)
        runner, channel.runner = channel.runner, None
        if runner is not None and not runner.done():
            runner.cancel()
            await asyncio.wait(
                [runner]
            )  # its CancelledError stays in it; ours (if we are cancelled) does not


def load_env(taskset: str, env_id: str | None, config: dict[str, Any]) -> Any:
    """The verifiers Env for ``taskset`` (a taskset id: an installed package or a module path), paired with the
    env ``env_id`` when given, configured by ``config`` (the rest of verifiers' ``[env]`` block). One
    interception server serves the worker (``interception.type = server``)."""
    data = {**config, "taskset": {**config.get("taskset", {}), "id": taskset}}
    if env_id:
        data["id"] = env_id
    data["interception"] = {**config.get("interception", {}), "type": "server"}
    return vf.load_environment(vf.resolve_env_config(data))


def task_list(env: Any, count: int) -> list[Any]:
    """The first ``count`` tasks of the env's taskset (an infinite taskset is cut)."""
    return list(env.taskset.take(count))


def episode_reward(episode: Any) -> tuple[float, dict[str, float], int]:
    """(reward, its components, model turns) of a finished verifiers episode with one trace; ValueError with
    verifiers' own message for a failed episode."""
    if not episode.ok or episode.errors:
        errors = list(episode.errors) + [e for t in episode.traces for e in getattr(t, "errors", [])]
        detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or "not ok"
        raise ValueError(f"the verifiers episode failed: {detail}")
    if len(episode.traces) != 1:
        raise ValueError(f"the verifiers episode has {len(episode.traces)} traces; one agent is supported")
    (trace,) = episode.traces
    components = {name: float(r.value) for name, r in trace.rewards.items() if r is not None}
    return float(trace.reward), components, int(trace.num_turns)
