"""The single-turn group workflow: each sample is one completion of the prompt, generated through the engine
session (aborts resubmitted, failed engines avoided), decoded only for the verifier, and scored in the reward
process pool right away; a timeout or an error becomes the sample's ``reward_status`` with reward 0."""

from __future__ import annotations

import time

import numpy as np

from broker.record import Sample
from rollout_fleet.rewards import SampleLength
from rollout_fleet.tasks import Prompt, RewardResult
from rollout_fleet.workflows.base import GroupWorkflow, SampleResult
from rollout_fleet.workflows.session import Answer, Generation


class SingleTurnWorkflow(GroupWorkflow):
    """Prompt in, ``group_size`` scored completions out."""

    async def sample(
        self, group_id: str, index: int, prompt_ids: list[int], prompt: Prompt, first: Answer | None
    ) -> SampleResult:
        generated = await self.session.generate(
            f"{group_id}:s{index}", prompt_ids, self.config.max_new_tokens, first
        )
        text = self.decode(generated.tokens)
        started = time.monotonic()
        length = SampleLength(generated.finish == "length", len(generated.tokens), self.config.max_new_tokens)
        reward = await self.scorer.score(prompt, text, length)
        generated.timings["reward_s"] = time.monotonic() - started
        return SampleResult(self._build_sample(index, generated, reward), text)

    def _build_sample(self, index: int, gen: Generation, reward: RewardResult) -> Sample:
        versions = np.asarray(gen.versions, dtype=np.int32)
        mask = np.ones(len(gen.tokens), dtype=np.uint8)
        if self.config.mask_resubmitted_prefix and gen.resubmits:
            mask[versions < versions[-1]] = (
                0  # tokens of an older policy than the one that finished the sample
            )
        return Sample(
            sample_index=index,
            output_ids=np.asarray(gen.tokens, dtype=np.int32),
            logprobs=np.asarray(gen.logprobs, dtype=np.float32),
            versions=versions,
            loss_mask=mask,
            finish_reason=gen.finish,
            truncated=gen.finish == "length",
            reward=float(reward.reward) if reward.status == "ok" else 0.0,
            engine_id=gen.engine_id,
            timings=gen.timings,
            num_resubmits=gen.resubmits,
            **self.reward_fields(reward),
        )
