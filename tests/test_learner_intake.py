"""The learner's intake on a real Redis stream: which delivered groups a step takes, and what goes stale.

Groups finish out of order: a group of long samples, started under an older policy, reaches the stream after
groups admitted later. In stream order it waits behind them and crosses the staleness bound; oldest first
trains it while it is within the bound, and the fresher groups it displaced are still within it a step later.
"""

from __future__ import annotations

import numpy as np
import pytest

from broker.client import connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.producer import Producer
from broker.record import synthetic_group
from broker.staleness import InMemoryCounters, StalenessManager
from common.config import SharedConfig
from learner.config import LearnerConfig
from learner.intake import Intake

ETA = 1
# (prompt index, version of every token) in stream order; prompt 2 is the late one, started under version 1
ARRIVALS = [(0, 2), (1, 2), (2, 1), (3, 2), (4, 2)]


async def run_two_steps(redis_url: str, order: str) -> tuple[list[list[int]], dict[str, int]]:
    """Produce ARRIVALS, then collect the batches of two steps (learner at version 2, then 3)."""
    shared = SharedConfig(run_id=f"intake-{order}", eta=ETA, redis_url=redis_url)
    client = connect(redis_url)
    producer = Producer(client, shared, BrokerConfig(), "p0")
    rng = np.random.default_rng(0)
    for index, version in ARRIVALS:
        await producer.send(
            synthetic_group(rng, shared.run_id, index, num_samples=2, num_tokens=4, version=version)
        )
    config = LearnerConfig(groups_per_step=2, intake_order=order)
    consumer = Consumer(client, shared, BrokerConfig(block_ms=50), "learner-0")
    admission = StalenessManager(ETA, 2, 100, InMemoryCounters())
    intake = Intake(consumer, admission, config, ETA, lambda: False)
    steps = []
    for learner_version in (2, 3):
        batch = await intake.next_batch(learner_version, max_wait_s=5)
        assert batch is not None
        steps.append([g.prompt_index for g in batch.groups])
    await client.aclose()
    return steps, intake.totals


async def test_oldest_first_trains_the_late_group_within_the_bound(redis_url: str) -> None:
    steps, totals = await run_two_steps(redis_url, "oldest_first")
    assert steps == [[2, 0], [1, 3]]  # the version-1 group first, then arrival order among equals
    assert totals == {"trained": 4}


async def test_arrival_order_lets_the_late_group_go_stale(redis_url: str) -> None:
    steps, totals = await run_two_steps(redis_url, "arrival")
    assert steps == [[0, 1], [3, 4]]
    assert totals["stale"] == 1 and totals["trained"] == 4  # prompt 2 at version 3: staleness 2 > 1


def test_intake_order_is_validated() -> None:
    with pytest.raises(ValueError, match="intake_order"):
        LearnerConfig(intake_order="newest_first")
