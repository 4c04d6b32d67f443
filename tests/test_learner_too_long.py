"""Bad input: a sample longer than the learner's maximum sequence length (by default the model's context).

Through the real path: a real Redis, the real producer, ``streamrl learner`` as a process. The group with the
over-long sample is refused with an error naming the group and its length, dropped as ``too_long`` (dropped
record, durable outcome, metrics, the audit), and the learner trains every other group.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import redis

from broker.client import BrokerKeys, connect
from broker.config import BrokerConfig
from broker.metrics import metrics_key
from broker.outcomes import audit, format_audit, read_outcomes
from broker.record import Sample, TrajectoryGroup
from common.config import SharedConfig
from learner.intake import TOO_LONG, drop_reason, longest_sample, sequence_limit
from rollout_fleet.model import TinyModelSpec, init_tiny_model
from tests.synth import sample_groups
from tests.test_learner_train import produce, start_learner

pytestmark = pytest.mark.timeout(300)

CONTEXT = 48  # the tiny model's max_position_embeddings here: the learner's limit when max_seq_len is unset
SHARED = SharedConfig(run_id="test")


def _lengthen(sample: Sample, tokens: int) -> Sample:
    """The same sample with its output repeated out to ``tokens`` tokens."""
    reps = -(-tokens // len(sample.output_ids))

    def tile(a: np.ndarray) -> np.ndarray:
        return np.tile(a, reps)[:tokens]

    return dataclasses.replace(
        sample,
        output_ids=tile(sample.output_ids),
        logprobs=tile(sample.logprobs),
        versions=tile(sample.versions),
        loss_mask=tile(sample.loss_mask),
    )


def _too_long_group(model_dir: str) -> TrajectoryGroup:
    group = sample_groups(model_dir, 1, 2, version=0, start_index=50)[0]
    group.samples[1] = _lengthen(group.samples[1], CONTEXT)  # prompt + CONTEXT tokens > CONTEXT
    return group


def test_sequence_limit_and_the_drop_reason(tmp_path) -> None:
    assert sequence_limit(None, 4096) == 4096
    assert sequence_limit(1024, 4096) == 1024
    assert sequence_limit(None, None) is None
    with pytest.raises(ValueError, match=r"learner\.max_seq_len = 8192 exceeds .* = 4096"):
        sequence_limit(8192, 4096)
    model_dir = init_tiny_model(tmp_path / "model", TinyModelSpec(max_position_embeddings=CONTEXT))
    group = _too_long_group(str(model_dir))
    index, length = longest_sample(group)
    assert index == 1 and length == len(group.prompt_ids) + CONTEXT
    assert drop_reason(group, 0, 1, False, max_seq_len=length) is None
    assert drop_reason(group, 0, 1, False, max_seq_len=length - 1) == TOO_LONG
    assert drop_reason(group, 5, 1, False, max_seq_len=length - 1) == TOO_LONG  # bad input before staleness


def test_learner_drops_the_too_long_group_and_trains_the_others(tmp_path, redis_url: str) -> None:
    model_dir = init_tiny_model(tmp_path / "model", TinyModelSpec(max_position_embeddings=CONTEXT))
    normal = sample_groups(str(model_dir), 4, 2, version=0)
    assert all(longest_sample(g)[1] <= CONTEXT for g in normal)
    bad = _too_long_group(str(model_dir))
    _, bad_length = longest_sample(bad)
    produce(redis_url, [normal[0], bad, *normal[1:]])  # the bad group in the middle of the stream

    # with checkpointing and bf16 on, as a long-sequence run has them: the trainer passes both to shard_model
    proc = start_learner(
        tmp_path, redis_url, model_dir, "--learner.world_size=1", "--learner.groups_per_step=2",
        "--learner.max_steps=2", "--learner.checkpoint_every=2", "--learner.activation_checkpointing=true",
        "--learner.mixed_precision=bf16",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "activation checkpointing on, compute dtype torch.bfloat16" in out

    # refused with an error naming the group, its length and the limit (the model's context)
    refusal = [line for line in out.splitlines() if bad.group_id in line and TOO_LONG in line]
    assert refusal and "ERROR" in refusal[0], out[-3000:]
    assert f"{bad_length} tokens" in refusal[0] and f"max_seq_len {CONTEXT}" in refusal[0]

    # the learner kept running: two steps over the other four groups
    client = redis.Redis.from_url(redis_url)
    keys = BrokerKeys.of(SHARED, BrokerConfig())
    assert int(client.get(keys.version)) == 2
    dropped = client.xrange(keys.dropped)
    assert [(f[b"gid"].decode(), f[b"reason"].decode()) for _, f in dropped] == [(bad.group_id, TOO_LONG)]
    assert f"{bad_length} tokens".encode() in dropped[0][1][b"detail"]
    assert client.hget(keys.counters, f"dropped:{TOO_LONG}") == b"1"
    points = client.xrange(metrics_key(SHARED, "learner"))
    assert float(points[-1][1][f"total/{TOO_LONG}".encode()]) == 1
    assert client.xpending(keys.stream, "learner")["pending"] == 0  # acknowledged with the checkpoint

    async def outcomes_and_audit() -> tuple[dict, object]:
        aclient = connect(redis_url)
        try:
            return await read_outcomes(aclient, keys), await audit(aclient, SHARED, BrokerConfig())
        finally:
            await aclient.aclose()

    outcomes, report = asyncio.run(outcomes_and_audit())
    assert outcomes[bad.group_id].outcome == "dropped" and outcomes[bad.group_id].reason == TOO_LONG
    assert {outcomes[g.group_id].outcome for g in normal} == {"trained"}
    assert (report.generated, report.trained, report.dropped, report.lost) == (5, 4, 1, 0), report
    assert report.dropped_by_reason == {TOO_LONG: 1} and report.ok
    assert f"dropped        1 ({TOO_LONG} 1)" in format_audit(report)
