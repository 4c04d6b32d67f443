"""The ``task`` config section: which task the rollout workers run and with which options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from common.configlib import Section
from rollout_fleet.tasks import Task, accepted_options, get_task, task_factory


class TaskConfig(Section):
    """The task: prompts plus verifier. Options left unset (null) take the task's own default."""

    name: str = Field(
        "arithmetic",
        description="Task: arithmetic, long_multiplication, gsm8k, countdown, dataset, tool_arithmetic (multi-turn, "
        "a calculator tool), openenv (an OpenEnv server, task.env_url), verifiers (a verifiers environment, "
        "task.verifiers_taskset), or package.module:Class.",
    )
    seed: int | None = Field(
        None, ge=0, description="Seed of generated prompts (arithmetic, long_multiplication, countdown)."
    )
    train_size: int | None = Field(
        None,
        ge=1,
        description="Generated train prompts per epoch (arithmetic, long_multiplication, countdown).",
    )
    heldout_size: int | None = Field(
        None, ge=1, description="Generated held-out prompts (arithmetic, long_multiplication, countdown)."
    )
    format_weight: float | None = Field(
        None, ge=0, description="reward = correct + format_weight * format (default 0)."
    )
    step_weight: float | None = Field(
        None,
        ge=0,
        description="long_multiplication: reward adds step_weight * the fraction of right steps (0.5).",
    )
    min_digits: int | None = Field(
        None, ge=1, description="long_multiplication: fewest digits of each factor (default 1)."
    )
    max_digits: int | None = Field(
        None,
        ge=1,
        description="long_multiplication: most digits of each factor (default 27: outputs <= 16k).",
    )
    dataset: str | None = Field(
        None, description="Train prompts: a .jsonl/.json/.parquet/.arrow file or save_to_disk folder."
    )
    dataset_split: str | None = Field(
        None, description="Split of a save_to_disk DatasetDict folder for train prompts."
    )
    test_dataset: str | None = Field(None, description="Held-out prompts file or folder (dataset tasks).")
    test_split: str | None = Field(
        None, description="Split of a save_to_disk DatasetDict folder for held-out prompts."
    )
    prompt_field: str | None = Field(
        None, description="Field (dotted path allowed) holding the prompt text or messages."
    )
    answer_field: str | None = Field(
        None, description="Field (dotted path allowed) holding the reference answer."
    )
    chat_template: Literal["auto", "always", "never"] | None = Field(
        None, description="auto: template message lists only; always: also plain strings; never: raw text."
    )
    system_prompt: str | None = Field(
        None, description="System message added when a plain prompt is templated."
    )
    instruction: str | None = Field(None, description="Text appended on a new line to every dataset prompt.")
    env_url: str | None = Field(
        None,
        description="openenv: URL of the OpenEnv environment server (http://host:port); checked at start.",
    )
    env_action_field: str | None = Field(
        None, description="openenv: the action field that receives the model's turn text (default message)."
    )
    env_observation_field: str | None = Field(
        None,
        description="openenv: the observation field shown to the model (default: the whole observation as JSON).",
    )
    env_observation_role: str | None = Field(
        None, description="openenv: chat role of the observation messages after the first (default user)."
    )
    env_timeout_s: float | None = Field(
        None,
        gt=0,
        description="openenv: seconds to connect and for each reset / step answer (default 30); verifiers: "
        "seconds to wait for each model call or the rollout's end (default 60).",
    )
    verifiers_taskset: str | None = Field(
        None, description="verifiers: the taskset id (an installed package or a module path)."
    )
    verifiers_env: str | None = Field(
        None, description="verifiers: the Env id to pair with the taskset (default: the taskset's own)."
    )
    verifiers_config: dict[str, Any] | None = Field(
        None,
        description="verifiers: the rest of the env config (verifiers' [env] block: taskset options, agents, "
        "harness, runtime).",
    )
    use_all: bool | None = Field(
        None, description="Countdown: every number must be used (default: at most once)."
    )

    def options(self) -> dict[str, Any]:
        """The options that are set, as keyword arguments of the task."""
        return {k: v for k, v in self.model_dump().items() if k != "name" and v is not None}


class RewardConfig(Section):
    """The reward process pool: verifiers run in worker processes with a timeout."""

    function: str | None = Field(
        None,
        description="Custom reward 'package.module:function' called as fn(prompt, completion); default: the task's verifier.",
    )
    workers: int = Field(2, ge=1, description="Reward worker processes per rollout worker.")
    timeout_s: float = Field(
        5.0, gt=0, description="Seconds a reward call may take; past it the worker is killed, reward 0."
    )
    load_timeout_s: float = Field(
        60.0, gt=0, description="Seconds to start a reward worker and import its scorer."
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "forkserver", description="How reward workers start (never fork: the parent has threads)."
    )
    max_memory_bytes: int | None = Field(
        8 << 30,
        ge=1 << 26,
        description="Address space of each reward worker (RLIMIT_AS); past it the call is an error; None: no "
        "limit (needed by a scorer that initializes CUDA).",
    )


def build_task(config: TaskConfig, tokenizer: Any = None) -> Task:
    """The configured task; the tokenizer goes to tasks that take one (for chat templates)."""
    options = config.options()
    accepted = accepted_options(task_factory(config.name))
    if tokenizer is not None and (accepted is None or "tokenizer" in accepted):
        options["tokenizer"] = tokenizer
    return get_task(config.name, **options)
