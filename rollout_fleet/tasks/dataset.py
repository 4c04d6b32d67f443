"""Tasks whose prompts come from dataset files: a train file and an optional held-out (test) file.

Train rows whose rendered prompt text equals a held-out prompt are left out (and counted in
``excluded_overlap``), so held-out prompts are disjoint from training prompts by construction.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rollout_fleet.datasets import ChatFormatter, PromptDataset
from rollout_fleet.tasks.base import (
    CHAT_TEMPLATE_DOC,
    TEST,
    TRAIN,
    ChatTemplate,
    FileTaskOptions,
    Prompt,
    RewardResult,
    Task,
    TaskError,
    Weight,
    strip_special,
    weighted_reward,
)


class DatasetConfig(FileTaskOptions):
    """dataset: prompt and answer fields of dataset files, scored by exact match."""

    name: Literal["dataset"] = Field("dataset", description="The task.")
    prompt_field: str = Field(
        "prompt", description="Field (dotted path allowed) holding the prompt text or messages."
    )
    answer_field: str = Field(
        "answer", description="Field (dotted path allowed) holding the reference answer."
    )
    chat_template: ChatTemplate = Field("auto", description=CHAT_TEMPLATE_DOC)
    instruction: str | None = Field(None, description="Text appended on a new line to every prompt.")
    format_weight: Weight = Field(0.0, description="reward = correct + format_weight * format.")


class DatasetTask(Task):
    """Prompt and answer fields from a dataset; scored by exact match of the stripped completion.

    Exact match is a placeholder verifier: use a subclass (gsm8k) or a custom reward function by import path.
    Prompts are loaded lazily, so a reward worker can build the task to score without reading any file.
    """

    name = "dataset"
    version = "1"
    Config = DatasetConfig

    def __init__(self, config: DatasetConfig | None = None, /, tokenizer: Any = None, **options: Any) -> None:
        c = self.configure(config, options)
        self.format_weight = c.format_weight
        fields = {
            "prompt_field": c.prompt_field,
            "answer_field": c.answer_field,
            "formatter": ChatFormatter(c.chat_template, tokenizer, c.system_prompt),
            "instruction": c.instruction,
        }
        self._datasets: dict[str, PromptDataset | None] = {
            TRAIN: PromptDataset(c.dataset, split=c.dataset_split, **fields) if c.dataset else None,
            TEST: PromptDataset(c.test_dataset, split=c.test_split, **fields) if c.test_dataset else None,
        }
        self._disjoint = False

    def _dataset(self, split: str) -> PromptDataset | None:
        self._check_request(0, split)
        if not self._disjoint:
            train, test = self._datasets[TRAIN], self._datasets[TEST]
            if train is not None and test is not None:
                train.exclude = test.texts()
            self._disjoint = True
        return self._datasets[split]

    @property
    def excluded_overlap(self) -> int:
        """Train rows left out because their prompt is also a held-out prompt."""
        train = self._dataset(TRAIN)
        if train is None:
            return 0
        len(train)  # loads and filters the rows
        return train.excluded

    def num_prompts(self, split: str = TRAIN) -> int:
        data = self._dataset(split)
        if data is None and split == TRAIN:
            raise TaskError(f"task {self.name}: option dataset (a file or folder of prompts) is required")
        return 0 if data is None else len(data)

    def make_prompt(self, index: int, split: str = TRAIN) -> Prompt:
        self._check_request(index, split)
        n = self.num_prompts(split)
        if index >= n:
            raise TaskError(f"task {self.name}: {split} index {index} out of range ({n} prompts)")
        data = self._dataset(split)
        assert data is not None
        row, text, answer = data.item(index)
        return Prompt(
            prompt_id=f"{self.name}/{split}/{row}",
            text=text,
            answer=self.gold_answer(answer),
            split=split,
            index=index,
            metadata={"row": row},
        )

    def gold_answer(self, raw: str) -> str:
        """The reference answer as the verifier wants it, from the dataset's answer field."""
        return raw.strip()

    def score(self, prompt: Prompt, completion: str) -> RewardResult:
        correct = 1.0 if strip_special(completion).strip() == prompt.answer else 0.0
        return weighted_reward(correct, 1.0, self.format_weight)
