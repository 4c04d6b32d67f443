"""Every policy loss trains a real step of the tiny model through the learner's own step function (in process,
off-policy behaviour log-probs), and a loss selected on the command line reaches a real learner process (1 rank)
that trains from a real Redis stream of synthetic groups and publishes a version with a finite loss in its
metrics stream. (Each loss's formula: tests/test_losses.py; its selection by name through the config loader:
test_every_loss_is_selectable_by_name_and_differs there.)"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
import redis
import torch

from broker.client import BrokerKeys
from broker.config import BrokerConfig
from broker.metrics import metrics_key
from common.config import SharedConfig
from learner.attention import register_packed_attention
from learner.config import LearnerConfig, LossConfig
from learner.losses import POLICY_LOSSES
from learner.step import train_step
from rollout_fleet.model import init_tiny_model
from tests.learner_batch import make_sequences, rank_inputs
from tests.synth import sample_groups
from tests.test_learner_train import produce, start_learner

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def model_and_groups(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    model_dir = init_tiny_model(tmp_path_factory.mktemp("loss_model") / "model")
    groups = sample_groups(str(model_dir), 2, 2, version=0, max_new_tokens=8)
    for group in groups:  # the toy reward rarely differs within a group; give every group a signal
        for i, sample in enumerate(group.samples):
            sample.reward = float(i % 2)
            sample.reward_components = {"correct": sample.reward}
    return model_dir, groups


def test_each_policy_loss_trains_a_real_step_of_the_model(tmp_path: Path) -> None:
    """One train_step per loss from the same weights on the same off-policy batch (behaviour log-probs about 0.3
    nats from the model's, both signs: ratios and weights away from 1, so clipping, truncation and masking all
    act): each applies a finite, non-zero update, and no two losses give the same loss value or update."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model_dir = init_tiny_model(tmp_path / "model")
    seqs, temps = make_sequences(12, seed=5, group_size=4)
    results: dict[str, tuple[float, torch.Tensor]] = {}
    for loss in sorted(POLICY_LOSSES):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
        )
        config = LearnerConfig(world_size=1, micro_batch_tokens=128, loss=LossConfig(policy_loss=loss))
        mbs, mb_temps, normaliser = rank_inputs(seqs, temps, config, 1, 0)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        result = train_step(model, opt, mbs, mb_temps, config, normaliser, learner_version=0)
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert result.applied and math.isfinite(result.metrics["loss"]), (loss, result.metrics)
        assert result.metrics["grad_norm"] > 0 and torch.isfinite(after).all(), loss
        results[loss] = (result.metrics["loss"], after - before)
    assert len({round(value, 7) for value, _ in results.values()}) == len(results), results
    updates = list(results.items())
    for i, (a, (_, da)) in enumerate(updates):
        for b, (_, db) in updates[i + 1 :]:
            assert not torch.allclose(da, db), (a, b)


# One loss other than the default through the command line and a real process: the selection reaches the ranks.
@pytest.mark.parametrize("loss", ["gspo"])
def test_a_policy_loss_chosen_on_the_command_line_trains_a_learner_process(
    loss: str, model_and_groups: tuple[Path, list], tmp_path: Path, redis_url: str
) -> None:
    model_dir, groups = model_and_groups
    # DAPO dynamic sampling through the learner: two groups of equal rewards ahead of the two with signal are
    # dropped (zero_signal, counted, capacity given back) and the step still trains groups_per_step = 2 groups
    flat = sample_groups(str(model_dir), 2, 2, version=0, max_new_tokens=8, start_index=50)
    for group in flat:
        for sample in group.samples:
            sample.reward, sample.reward_components = 1.0, {"correct": 1.0}
    produce(redis_url, [*flat, *groups])
    proc = start_learner(
        tmp_path, redis_url, model_dir, "--learner.world_size=1", "--learner.groups_per_step=2",
        "--learner.max_steps=1", "--learner.export_at_end=false", f"--learner.loss.policy_loss={loss}",
        "--learner.advantage.drop_zero_signal=true",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=80)
    assert proc.returncode == 0, out

    dumped = tomllib.loads((tmp_path / "run" / "config.learner.toml").read_text())
    assert dumped["learner"]["loss"]["policy_loss"] == loss  # the ranks ran with this loss
    client = redis.Redis.from_url(redis_url)
    keys = BrokerKeys.of(SharedConfig(run_id="test"), BrokerConfig())
    assert int(client.get(keys.version)) == 1
    points = client.xrange(metrics_key(SharedConfig(run_id="test"), "learner"))
    assert len(points) == 1
    metrics = {k.decode(): float(v) for k, v in points[0][1].items()}
    assert metrics["step_applied"] == 1.0 and metrics["skipped_steps"] == 0.0
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["samples"] == 4.0
    dropped = {f[b"gid"].decode(): f[b"reason"].decode() for _, f in client.xrange(keys.dropped)}
    assert dropped == {g.group_id: "zero_signal" for g in flat}
    assert metrics["dropped/zero_signal"] == 2.0  # counted in the step that read past them


@pytest.mark.parametrize(("kl_mode", "offload"), [("loss", False), ("reward", True)])
def test_trust_region_reference_kl_entropy_and_schedule_on_two_ranks(
    kl_mode: str, offload: bool, tmp_path: Path, redis_url: str
) -> None:
    """Two gloo ranks, two minibatches per step (proximal pass, then two updates), the FSDP2-sharded frozen
    reference and an entropy bonus, under a cosine schedule: every collective lines up, the reference KL is
    positive (the second update of the first step already runs on moved weights), and the learning rate decays.
    As a reward penalty the KL is 0 at the first step: its tokens were sampled by the reference itself; that case
    keeps the reference's shards in host memory (learner.reference_offload), so the 0 also says the offloaded
    reference computes what the policy it was loaded as computes."""
    model_dir = init_tiny_model(tmp_path / "model")
    groups = sample_groups(str(model_dir), 4, 2, version=0, max_new_tokens=8)
    for group in groups:
        for i, sample in enumerate(group.samples):
            sample.reward = float(i % 2)
            sample.reward_components = {"correct": sample.reward}
    produce(redis_url, groups)
    proc = start_learner(
        tmp_path, redis_url, model_dir, "--learner.groups_per_step=2", "--learner.max_steps=2",
        "--learner.export_at_end=false", "--learner.ppo_minibatches=2", "--learner.lr=0.05",
        "--learner.lr_schedule=cosine", "--learner.lr_decay_steps=2", "--learner.loss.kl_coef=0.5",
        f"--learner.loss.kl_mode={kl_mode}", "--learner.loss.entropy_coef=0.01",
        f"--learner.reference_offload={str(offload).lower()}",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=80)
    assert proc.returncode == 0, out
    client = redis.Redis.from_url(redis_url)
    points = client.xrange(metrics_key(SharedConfig(run_id="test"), "learner"))
    steps = [{k.decode(): float(v) for k, v in p[1].items()} for p in points]
    assert [m["step"] for m in steps] == [1.0, 2.0]
    assert [m["updates_taken"] for m in steps] == [2.0, 2.0]
    assert all(m["kl_ref"] > 1e-6 for m in steps)
    # cosine over 2 steps: the first step runs at lr (factor 1), the second at half of it
    assert [m["lr"] for m in steps] == pytest.approx([0.025, 0.0])
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in steps)
    if kl_mode == "reward":
        assert steps[0]["kl_reward_penalty"] == pytest.approx(0.0, abs=1e-6)
