"""The cumulative counters of one rollout worker, shared by its shell and its workflows (the engine session counts
requests and failures, a workflow counts samples and episodes); the metrics stream shows their rates under these
names."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from broker.record import TrajectoryGroup


@dataclass
class WorkerStats:
    """Cumulative counters of one worker (the metrics stream shows their rates)."""

    groups_started: int = 0
    groups_produced: int = 0
    groups_duplicate: int = 0  # produced, but the group id was already in the stream (a re-leased prompt)
    groups_dropped: Counter = field(default_factory=Counter)  # by reason
    groups_handed_back: int = 0
    leases_lost: int = 0
    samples: int = 0
    tokens: int = 0
    requests: int = 0  # engine requests (a batched /generate of n prompts counts n)
    batch_requests: int = 0  # batched /generate calls (one per group with batch_group_requests)
    batch_fallbacks: int = 0  # batches that failed, their samples then sent one by one
    resubmits: int = 0
    zero_token_aborts: int = 0
    engine_failures: int = 0
    invalid_responses: int = 0
    rejected_requests: int = 0
    worker_errors: int = 0
    reward_status: Counter = field(default_factory=Counter)
    episodes: int = 0  # multi-turn samples finished
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    episode_ends: Counter = field(default_factory=Counter)  # why episodes ended: done, eos, max_turns, ...
    reward_sum: float = 0.0
    reward_count: int = 0
    wait_capacity_s: float = 0.0
    finished: bool = False  # every prompt up to max_epochs is done

    def count_group(self, group: TrajectoryGroup) -> None:
        """Count a produced group's samples, tokens and good rewards."""
        for s in group.samples:
            self.samples += 1
            self.tokens += s.num_tokens()
            if s.reward_status == "ok":
                self.reward_sum += s.reward
                self.reward_count += 1

    def flat(self) -> dict[str, float]:
        out = {k: float(v) for k, v in vars(self).items() if isinstance(v, int | float)}
        out["groups_dropped"] = float(sum(self.groups_dropped.values()))
        out.update({f"groups_dropped/{k}": float(v) for k, v in self.groups_dropped.items()})
        out.update({f"reward_status/{k}": float(v) for k, v in self.reward_status.items()})
        out.update({f"episode_end/{k}": float(v) for k, v in self.episode_ends.items()})
        return out
