"""OpenEnv environments (``openenv-core``, the ``openenv`` extra) as episodes of the worker.

An OpenEnv environment is an HTTP server (FastAPI, ``openenv.core.env_server.create_app``); an episode is one
WebSocket session on its ``/ws`` route (its stateless ``/reset`` and ``/step`` routes make a fresh environment
per call, so they cannot run a multi-step episode). The client here is openenv-core's own
``GenericEnvClient``: actions and observations are plain dicts, no environment package is installed locally.

    prompt    = the first observation (reset with the prompt's seed) as a user message, templated
    action    = {env_action_field: the model's turn text, end-of-turn token stripped}
    observe   = observation[env_observation_field] (or the whole observation as JSON) as an
                ``env_observation_role`` message, rendered by the tokenizer's chat template as
                :func:`tools.tool_observation` renders a tool result: ids appended, earlier turns untouched
    reward    = the environment's step rewards (component ``env``); done ends the episode

A group's samples share one prompt, so the environment must be deterministic given the reset seed: the worker
resets once to render the prompt (:meth:`OpenEnvTask.prepare_prompt`) and each sample's reset must render the
same text, else the group is dropped with reason ``env_error``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator

from rollout_fleet.envs.base import Environment, EnvironmentTask, StepResult
from rollout_fleet.envs.tools import tool_observation
from rollout_fleet.tasks.base import (
    TEST,
    TRAIN,
    Prompt,
    RewardResult,
    Seed,
    Size,
    TaskError,
    TaskOptions,
    strip_special,
)

INSTALL_HINT = "the openenv task needs openenv-core: pip install 'streamrl[openenv]'"


def _client_class() -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise TaskError(f"{INSTALL_HINT} ({exc})") from None
    return GenericEnvClient


def check_url(url: Any) -> str:
    """The URL without a trailing slash; TaskError for anything but an http(s):// or ws(s):// URL with a host."""
    parsed = urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https", "ws", "wss") or not parsed.hostname:
        raise TaskError(
            f"task openenv: env_url = {url!r} is not the URL of an OpenEnv server "
            "(http://host:port, https://, ws:// or wss://)"
        )
    try:
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise TaskError(f"task openenv: env_url = {url!r}: {exc}") from None
    return url.rstrip("/")


def observation_text(observation: Any, field: str | None) -> str:
    """The text a model sees of one observation dict: one field's value, or the whole dict as JSON."""
    if field:
        if not isinstance(observation, dict) or field not in observation:
            keys = sorted(observation) if isinstance(observation, dict) else type(observation).__name__
            raise KeyError(f"the observation has no field {field!r} (it has {keys})")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return json.dumps(observation, sort_keys=True, separators=(",", ":"))


class OpenEnvEnvironment(Environment):
    """One episode: one WebSocket session of an OpenEnv server, opened at reset and closed at close."""

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        reset_kwargs: dict[str, Any],
        action_field: str,
        observation_field: str | None,
        observation_role: str,
        system_prompt: str | None,
        timeout_s: float,
    ) -> None:
        self.url = url
        self.tokenizer = tokenizer
        self.reset_kwargs = dict(reset_kwargs)  # seed: the prompt's, so every sample of a group starts alike
        self.action_field = action_field
        self.observation_field = observation_field
        self.observation_role = observation_role
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.client: Any = None  # openenv's GenericEnvClient while the session is open
        self.steps = 0

    def render_prompt(self, observation: Any) -> str:
        """The first observation as the prompt: (system,) user message and the assistant header."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": observation_text(observation, self.observation_field)})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def reset(self) -> str:
        await self.close()
        client = _client_class()(
            base_url=self.url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
        )
        await client.connect()
        self.client = client
        self.steps = 0
        result = await client.reset(**self.reset_kwargs)
        return self.render_prompt(result.observation)

    async def step(self, action: str) -> StepResult:
        if self.client is None:
            raise RuntimeError("step before reset: the OpenEnv session is not open")
        self.steps += 1
        text = strip_special(action)
        result = await self.client.step({self.action_field: text})
        reward = float(result.reward) if result.reward is not None else 0.0
        info: dict[str, Any] = {"openenv_step": self.steps}
        if result.done:
            return StepResult(reward=reward, done=True, info=info)
        content = observation_text(result.observation, self.observation_field)
        observation = tool_observation(self.tokenizer, content, role=self.observation_role)
        return StepResult(observation=observation, reward=reward, done=False, info=info)

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.disconnect()


class OpenEnvConfig(TaskOptions):
    """openenv: episodes against an OpenEnv environment server (the openenv extra)."""

    name: Literal["openenv"] = Field("openenv", description="The task.")
    env_url: str = Field(
        description="URL of the OpenEnv environment server (http://host:port); checked at start."
    )
    seed: Seed = Field(0, description="Seed the reset seeds of the prompts derive from.")
    train_size: Size = Field(1000, description="Train prompts (environment resets) per epoch.")
    heldout_size: Size = Field(100, description="Held-out prompts (environment resets).")
    env_action_field: str = Field(
        "message", min_length=1, description="The action field that receives the model's turn text."
    )
    env_observation_field: str | None = Field(
        None, description="The observation field shown to the model (default: the whole observation as JSON)."
    )
    env_observation_role: str = Field(
        "user", description="Chat role of the observation messages after the first."
    )
    env_timeout_s: float = Field(
        30.0, gt=0, description="Seconds to connect and for each reset / step answer."
    )
    system_prompt: str | None = Field(None, description="System message before the first observation.")

    @field_validator("env_url")
    @classmethod
    def _url(cls, url: str) -> str:
        return check_url(url)


class OpenEnvTask(EnvironmentTask):
    """Episodes against an OpenEnv server at ``env_url``; prompt i resets it with a seed derived from
    (seed, split, i), so prompts are reproducible and the train and held-out seeds differ."""

    name = "openenv"
    version = "1"
    Config = OpenEnvConfig

    def __init__(self, config: OpenEnvConfig | None = None, /, tokenizer: Any = None, **options: Any) -> None:
        c = self.configure(config, options)
        self.url, self.seed, self.train_size, self.heldout_size = (
            c.env_url,
            c.seed,
            c.train_size,
            c.heldout_size,
        )
        self.action_field = c.env_action_field
        self.observation_field = c.env_observation_field
        self.observation_role = c.env_observation_role
        self.timeout_s = c.env_timeout_s
        self.system_prompt = c.system_prompt
        self.tokenizer = tokenizer

    def num_prompts(self, split: str = TRAIN) -> int:
        self._check_request(0, split)
        return self.train_size if split == TRAIN else self.heldout_size

    def reset_seed(self, split: str, index: int) -> int:
        digest = hashlib.sha256(f"openenv:{self.seed}:{split}:{index}".encode()).digest()
        return int.from_bytes(digest[:4], "big") >> 1  # OpenEnv's ResetRequest takes seeds >= 0

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        """The prompt's identity and reset seed; its text is the first observation, filled in by
        :meth:`prepare_prompt` (it needs the server)."""
        self._check_request(index, split)
        if index >= self.num_prompts(split):
            raise TaskError(f"task openenv: {split} index {index} out of range ({self.num_prompts(split)})")
        seed = self.reset_seed(split, index)
        return Prompt(
            prompt_id=f"openenv/{self.seed}/{split}/{index}",
            text="",
            answer="",
            split=split if split in (TRAIN, TEST) else TEST,
            index=index,
            metadata={"reset_seed": seed, "env_url": self.url},
        )

    def make_env(self, prompt: Prompt) -> OpenEnvEnvironment:
        if self.tokenizer is None:
            raise TaskError("task openenv: make_env needs the tokenizer (observations are templated)")
        return OpenEnvEnvironment(
            self.url,
            self.tokenizer,
            {"seed": int(prompt.metadata["reset_seed"])},
            self.action_field,
            self.observation_field,
            self.observation_role,
            self.system_prompt,
            self.timeout_s,
        )

    async def prepare_prompt(self, prompt: Prompt) -> Prompt:
        return await self.prompt_from_reset(prompt)

    async def check(self) -> str:
        """At worker start: the server answers ``/health`` and a session opens, else a TaskError naming the URL."""
        import aiohttp

        client_class = _client_class()
        http_url = self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as http, http.get(http_url + "/health") as resp:
                if resp.status != 200:
                    raise TaskError(f"task openenv: {http_url}/health answered HTTP {resp.status}")
            client = client_class(base_url=self.url, connect_timeout_s=self.timeout_s)
            await client.connect()
            await client.disconnect()
        except TaskError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same error for the user
            raise TaskError(
                f"task openenv: no OpenEnv server at env_url = {self.url!r} ({type(exc).__name__}: {exc})"
            ) from None
        return f"OpenEnv server at {self.url}"

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        """No verifier of its own: the environment's step rewards are the reward (component ``env``)."""
        return RewardResult(reward=0.0, components={})
