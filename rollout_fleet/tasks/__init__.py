"""Tasks: prompt sources plus verifiers, picked by name from the config.

    task = get_task("arithmetic", seed=0)
    prompt = task.make_prompt(17, "train")       # Prompt(prompt_id, text, answer, split, index, metadata)
    result = task.score(prompt, completion_text)  # RewardResult(reward, components, status, error)

Built in: ``arithmetic`` (the tiny model's task), ``long_multiplication`` (its long-output task: scratchpads of
hundreds to ~16,000 tokens), ``gsm8k``, ``countdown``, ``dataset`` (prompt and answer fields, exact match) and
``tool_arithmetic`` (multi-turn: multiplication with a calculator tool; see rollout_fleet.envs).
A custom task is a class or factory given by import path, ``"package.module:Name"``. Each built-in task declares
its options as a pydantic config class (``Task.Config``, a ``TaskOptions``), and ``rollout_fleet.tasks.config``
makes the ``rollout.task`` section a union of them selected by ``name``.
Importing this package imports neither torch nor transformers (reward workers import it).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from rollout_fleet.tasks.base import (
    REWARD_STATUSES,
    SPLITS,
    TEST,
    TRAIN,
    Prompt,
    RewardResult,
    Task,
    TaskError,
    TaskOptions,
)

__all__ = [
    "REWARD_STATUSES",
    "SPLITS",
    "TEST",
    "TRAIN",
    "Prompt",
    "RewardResult",
    "Task",
    "TaskError",
    "TaskOptions",
    "accepted_options",
    "available_tasks",
    "get_task",
    "load_object",
    "register_task",
    "task_factory",
]

_REGISTRY: dict[str, str | Callable[..., Task]] = {
    "arithmetic": "rollout_fleet.tasks.arithmetic:ArithmeticTask",
    "gsm8k": "rollout_fleet.tasks.gsm8k:GSM8KTask",
    "countdown": "rollout_fleet.tasks.countdown:CountdownTask",
    "long_multiplication": "rollout_fleet.tasks.long_multiplication:LongMultiplicationTask",
    "dataset": "rollout_fleet.tasks.dataset:DatasetTask",
    "tool_arithmetic": "rollout_fleet.tasks.tool_arithmetic:ToolArithmeticTask",
    "openenv": "rollout_fleet.envs.openenv:OpenEnvTask",
    "verifiers": "rollout_fleet.envs.verifiers_env:VerifiersTask",
}


def load_object(path: str, what: str = "object") -> Any:
    """The object at ``"package.module:attribute"`` (dots allowed in the attribute); errors name the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"{what} {path!r} is not an import path of the form 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"{what} {path!r}: cannot import module {module_name!r} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def register_task(name: str, factory: str | Callable[..., Task]) -> None:
    """Make ``get_task(name)`` build tasks with ``factory`` (a callable or an import path)."""
    _REGISTRY[name] = factory


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def task_factory(name: str) -> Callable[..., Task]:
    """The class (or factory) of a registered task name or of an import path ``package.module:Name``."""
    if name in _REGISTRY:
        factory = _REGISTRY[name]
        return load_object(factory, f"task {name}") if isinstance(factory, str) else factory
    if ":" in name:
        return load_object(name, "task")
    raise TaskError(
        f"unknown task {name!r}; built-in tasks are {available_tasks()}, or give 'package.module:Class'"
    )


def get_task(name: str, **options: Any) -> Task:
    """Build a task by name; an option the task does not take is an error that lists the ones it does (a task
    with a ``Config`` checks the values too)."""
    factory = task_factory(name)
    accepted = accepted_options(factory)
    if accepted is not None:
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise TaskError(f"task {name} does not take option(s) {unknown}; it takes {sorted(accepted)}")
    task = factory(**options)
    if not isinstance(task, Task):
        raise TaskError(f"task {name!r} built a {type(task).__name__}, not a rollout_fleet.tasks.Task")
    return task


def accepted_options(factory: Callable[..., Any]) -> set[str] | None:
    """Keyword names the factory takes (a task class with a ``Config``: its fields, plus ``tokenizer`` when it
    takes one), or None when it takes any **kwargs."""
    params = inspect.signature(factory).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    config = getattr(factory, "Config", None)
    if isinstance(config, type) and issubclass(config, TaskOptions):
        return (set(config.model_fields) - {"name"}) | named
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return named
