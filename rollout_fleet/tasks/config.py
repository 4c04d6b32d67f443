"""The ``task`` config section: which task the rollout workers run and with which options.

Each task declares its own fields (its ``Config``, next to the task); ``rollout.task.name`` picks the class, so a
field of another task is an error naming the field and the task, and ``--help`` lists each task's fields under
its name. A name that is not built in (``package.module:Class``) takes any options and its class checks them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator

from common.configlib import Section, format_validation_error
from rollout_fleet.envs.openenv import OpenEnvConfig
from rollout_fleet.envs.verifiers_env import VerifiersConfig
from rollout_fleet.tasks import (
    Task,
    TaskError,
    TaskOptions,
    accepted_options,
    available_tasks,
    get_task,
    task_factory,
)
from rollout_fleet.tasks.arithmetic import ArithmeticConfig
from rollout_fleet.tasks.countdown import CountdownConfig
from rollout_fleet.tasks.dataset import DatasetConfig
from rollout_fleet.tasks.gsm8k import GSM8KConfig
from rollout_fleet.tasks.long_multiplication import LongMultiplicationConfig
from rollout_fleet.tasks.tool_arithmetic import ToolArithmeticConfig


class CustomTaskConfig(TaskOptions):
    """A task class given by import path (or register_task): any options, checked by the class when built."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = Field(description="package.module:Class")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if ":" not in name and name not in available_tasks():
            raise ValueError(
                f"unknown task {name!r}; built-in tasks are {sorted(BUILT_IN)}, or give 'package.module:Class'"
            )
        return name


BUILT_IN: dict[str, type[TaskOptions]] = {
    c.model_fields["name"].default: c
    for c in (
        ArithmeticConfig,
        LongMultiplicationConfig,
        GSM8KConfig,
        CountdownConfig,
        DatasetConfig,
        ToolArithmeticConfig,
        OpenEnvConfig,
        VerifiersConfig,
    )
}
CUSTOM = "custom"  # the variant of every name that is not a built-in task (package.module:Class)
DEFAULT_TASK = "arithmetic"


def _variant(value: Any) -> str:
    """Which config class validates a ``task`` section: the built-in task's, else the custom one."""
    name = (
        value.get("name", DEFAULT_TASK) if isinstance(value, dict) else getattr(value, "name", DEFAULT_TASK)
    )
    return name if name in BUILT_IN else CUSTOM


TaskConfig = Annotated[
    Annotated[ArithmeticConfig, Tag("arithmetic")]
    | Annotated[LongMultiplicationConfig, Tag("long_multiplication")]
    | Annotated[GSM8KConfig, Tag("gsm8k")]
    | Annotated[CountdownConfig, Tag("countdown")]
    | Annotated[DatasetConfig, Tag("dataset")]
    | Annotated[ToolArithmeticConfig, Tag("tool_arithmetic")]
    | Annotated[OpenEnvConfig, Tag("openenv")]
    | Annotated[VerifiersConfig, Tag("verifiers")]
    | Annotated[CustomTaskConfig, Tag(CUSTOM)],
    Discriminator(_variant),
]
"""The ``rollout.task`` section: ``name`` selects the task's own config class (built-in or custom)."""

_ADAPTER: TypeAdapter[TaskOptions] = TypeAdapter(TaskConfig)


def task_config(name: str = DEFAULT_TASK, **options: Any) -> TaskOptions:
    """The task section for ``name`` with ``options`` (what ``--rollout.task.*`` would give); a TaskError
    naming each bad field otherwise."""
    try:
        return _ADAPTER.validate_python({"name": name, **options})
    except ValidationError as exc:
        raise TaskError(f"task {name}: {format_validation_error(exc)}") from None


class RewardConfig(Section):
    """The reward process pool: verifiers run in worker processes with a timeout."""

    function: str | None = Field(
        None,
        description="Custom reward 'package.module:function' called as fn(prompt, completion) (plus truncated, "
        "output_tokens and max_output_tokens when it names them); default: the task's verifier.",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment: the last this many tokens of rollout.max_new_tokens cost a "
        "penalty rising linearly to overlong_penalty_factor at the budget (component 'overlong'); 0: off.",
    )
    overlong_penalty_factor: float = Field(
        1.0, gt=0, description="DAPO soft overlong punishment: the penalty at the output budget."
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


def build_task(config: TaskOptions, tokenizer: Any = None) -> Task:
    """The configured task; the tokenizer goes to tasks that take one (for chat templates)."""
    options = config.options()
    accepted = accepted_options(task_factory(config.name))
    if tokenizer is not None and (accepted is None or "tokenizer" in accepted):
        options["tokenizer"] = tokenizer
    return get_task(config.name, **options)
