"""The task interface every prompt source and verifier implements, and the values they exchange.

A task makes prompts (deterministically from an index and a split) and scores completions. Scoring is a pure
function of the prompt and the completion text, so the reward process pool can rebuild the task from its name
and options in another process without loading any data. Nothing here imports torch or transformers: the reward
workers import this module and must start fast.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import Field, ValidationError, model_validator

from common.configlib import Section, format_validation_error

TRAIN, TEST = "train", "test"
SPLITS = (TRAIN, TEST)
REWARD_STATUSES = ("ok", "timeout", "error")


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` is exactly what the engine receives (already chat-templated when that applies).

    Tokenise ``text`` with ``add_special_tokens=False``: a chat template's markers are in the text itself.
    ``answer`` is the reference answer the verifier compares against; ``metadata`` holds whatever else the
    verifier needs (e.g. the numbers of a countdown problem) and must be picklable and msgpack-friendly.
    """

    prompt_id: str
    text: str
    answer: str
    split: str = TRAIN
    index: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardResult:
    """The reward of one completion with every component, and whether scoring worked.

    ``status`` is ``ok``, ``timeout`` or ``error``; anything but ``ok`` has reward 0.0 and an ``error`` message,
    and its components are empty (nothing was measured).
    """

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None

    @classmethod
    def failed(cls, status: str, error: str) -> RewardResult:
        return cls(reward=0.0, components={}, status=status, error=error)


class TaskError(ValueError):
    """Bad task options or a bad prompt request; the message names the option or index and its value."""


# the option types tasks share; pydantic checks them (strict ints: a bool or 2.5 is not a seed)
Seed = Annotated[int, Field(strict=True, ge=0)]
Size = Annotated[int, Field(strict=True, ge=1)]
Weight = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class TaskOptions(Section):
    """The config of one task: ``name`` selects the class (``rollout.task.name``), the other fields are the
    task's keyword options. A field of another task is refused with an error naming the field and the task."""

    name: str

    @model_validator(mode="before")
    @classmethod
    def _only_own_fields(cls, data: Any) -> Any:
        # pydantic's own message ("Extra inputs are not permitted") would name neither the task nor its fields
        if isinstance(data, dict) and cls.model_config.get("extra") == "forbid":
            foreign = sorted(set(data) - set(cls.model_fields))
            if foreign:
                task = data.get("name", cls.model_fields["name"].default)
                own = sorted(set(cls.model_fields) - {"name"})
                raise ValueError(
                    f"{', '.join(foreign)}: not a field of task {task} (its fields: {', '.join(own)})"
                )
        return data

    def options(self) -> dict[str, Any]:
        """The task's keyword options: every field but ``name``, those left None omitted (None: the default)."""
        return {k: v for k, v in self.model_dump().items() if k != "name" and v is not None}


class GeneratedTaskOptions(TaskOptions):
    """The options of a task whose prompts are generated from a seed."""

    seed: Seed = Field(0, description="Seed of the generated prompts.")
    train_size: Size = Field(100_000, description="Generated train prompts per epoch.")
    heldout_size: Size = Field(200, description="Generated held-out (test) prompts.")
    format_weight: Weight = Field(0.0, description="reward = correct + format_weight * format.")


class FileTaskOptions(TaskOptions):
    """The options of a task whose prompts can come from dataset files (a train file and a held-out one)."""

    dataset: str | None = Field(
        None, description="Train prompts: a .jsonl/.json/.parquet/.arrow file or save_to_disk folder."
    )
    dataset_split: str | None = Field(
        None, description="Split of a save_to_disk DatasetDict folder for train prompts."
    )
    test_dataset: str | None = Field(None, description="Held-out prompts file or folder.")
    test_split: str | None = Field(
        None, description="Split of a save_to_disk DatasetDict folder for held-out prompts."
    )
    system_prompt: str | None = Field(
        None, description="System message added when a plain prompt is templated."
    )


ChatTemplate = Literal["auto", "always", "never"]
CHAT_TEMPLATE_DOC = "auto: template message lists only; always: also plain strings; never: raw text."

OptionsT = TypeVar("OptionsT", bound=TaskOptions)


def validate_options(config_class: type[OptionsT], task: str, options: Mapping[str, Any]) -> OptionsT:
    """``options`` as the task's config; a TaskError naming the task and each bad field otherwise."""
    try:
        return config_class.model_validate(dict(options))
    except ValidationError as exc:
        raise TaskError(f"task {task}: {format_validation_error(exc)}") from None


class Task(ABC):
    """A source of prompts plus their verifier.

    Subclasses set ``name`` and ``version`` (bump the version whenever prompts or scoring change, so caches keyed
    on it, like the warm-started model, are rebuilt).
    """

    name: ClassVar[str]
    version: ClassVar[str]
    Config: ClassVar[type[TaskOptions] | None] = None  # its options; None: the constructor's signature says

    @classmethod
    def configure(cls, config: TaskOptions | None, options: Mapping[str, Any]) -> Any:
        """The task's validated config: ``config`` as given, else ``options`` checked against ``cls.Config``."""
        assert cls.Config is not None, f"{cls.__name__} has no Config"
        if config is None:
            return validate_options(cls.Config, cls.name, options)
        if options:
            raise TaskError(f"task {cls.name}: give a config or options {sorted(options)}, not both")
        return config

    @abstractmethod
    def num_prompts(self, split: str = TRAIN) -> int:
        """Prompts in one epoch of ``split``."""

    @abstractmethod
    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        """The prompt at ``index`` of ``split``; the same arguments always give the same prompt."""

    @abstractmethod
    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        """Score the completion text (without the prompt); never raises on bad model output."""

    def difficulty(self, prompt: Prompt) -> str | None:
        """The difficulty bucket of a prompt (``"digits=3"``), for held-out accuracy per bucket; None: this task
        has no notion of difficulty, and its evaluations report no buckets."""
        return None

    def prompts(self, split: str = TRAIN) -> Iterator[Prompt]:
        """Every prompt of one epoch of ``split``, in index order."""
        for index in range(self.num_prompts(split)):
            yield self.make_prompt(index, split)

    def _check_request(self, index: int, split: str) -> None:
        if split not in SPLITS:
            raise TaskError(f"task {self.name}: unknown split {split!r}; expected one of {SPLITS}")
        if not isinstance(index, int) or index < 0:
            raise TaskError(f"task {self.name}: prompt index must be a non-negative int, got {index!r}")


def weighted_reward(correct: float, fmt: float, format_weight: float) -> RewardResult:
    """reward = correct + format_weight * format, with both components recorded."""
    return RewardResult(reward=correct + format_weight * fmt, components={"correct": correct, "format": fmt})


def strip_special(completion: str, specials: tuple[str, ...] = ("<|endoftext|>", "<|im_end|>")) -> str:
    """The completion without trailing end markers or whitespace (engines may keep the stop token's text)."""
    text = completion.rstrip()
    changed = True
    while changed:
        changed = False
        for marker in specials:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                changed = True
    return text
