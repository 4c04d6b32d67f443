"""Publishers: how the learner makes new weights visible to the rollout fleet."""

from __future__ import annotations

from torch import nn


class VersionOnlyPublisher:
    """No engines to update (tests of the learner alone, or engines that reload from the HF export): the
    learner's Redis version announcement is the whole publication."""

    def publish(self, model: nn.Module, version: int, initial: bool) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
