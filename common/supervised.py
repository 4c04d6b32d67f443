"""The supervised example: one home for what the data makers (rollout_fleet's warm-start datasets, the JSONL
reader of ``streamrl sft``) hand the supervised trainer (learner.sft)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids and a loss mask of the same length (1: the token is a target)."""

    ids: list[int]
    mask: list[int]

    @property
    def targets(self) -> int:
        return sum(self.mask)

    @classmethod
    def prompt_and_output(cls, prompt_ids: list[int], output_ids: list[int]) -> Example:
        """Prompt tokens carry no loss, output tokens do."""
        return cls(prompt_ids + output_ids, [0] * len(prompt_ids) + [1] * len(output_ids))
