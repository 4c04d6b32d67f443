"""2 real gloo ranks under FSDP2 against one plain process, on the same step batches: the loss normalisation
across micro-batches and ranks and FSDP2's gradient averaging give the same update as training the whole batch
at once; a non-finite loss on one rank skips the step on every rank; a checkpoint restores the optimizer state
and each rank's RNG streams."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from broker.server import free_port
from learner.attention import register_packed_attention
from learner.checkpoint import CheckpointManager, CheckpointMeta
from learner.config import LearnerConfig, LossConfig
from learner.distributed import full_parameters, init_distributed, shard_model
from learner.step import train_step
from rollout_fleet.model import init_tiny_model
from tests.learner_batch import make_sequences, rank_inputs

pytestmark = pytest.mark.timeout(120)

# (policy loss, aggregation, samples per prompt) of each step; each step trains a different batch on the
# previous step's weights. Samples sharing a prompt run as shared rows (the prompt once per row).
STEPS = [("decoupled_ppo", "token-mean", 1), ("gspo", "seq-mean", 4), ("tis", "seq-mean-token-sum", 3)]
LR, MOMENTUM = 0.1, 0.9


def _config(loss: str, aggregation: str) -> LearnerConfig:
    # no clipping: a clipped update hides a gradient that is off by a constant factor (e.g. the world size);
    # 16-token loss chunks: several per micro-batch, the last one short, with the lm-head weight FSDP2 gathered
    return LearnerConfig(
        micro_batch_tokens=64,
        loss_chunk_tokens=16,
        max_grad_norm=1e6,
        loss=LossConfig(policy_loss=loss, aggregation=aggregation),
    )


def _run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, world: int, rank: int) -> list[dict]:
    out = []
    for k, (loss, agg, group_size) in enumerate(STEPS):
        config = _config(loss, agg)
        seqs, temps = make_sequences(12, seed=k, group_size=group_size)
        mbs, mb_temps, normaliser = rank_inputs(seqs, temps, config, world, rank)
        result = train_step(model, opt, mbs, mb_temps, config, normaliser, learner_version=0)
        shared = sum(m.shares_prompts for m in mbs)
        out.append(
            {"applied": result.applied, "loss": result.metrics["loss"], "mbs": len(mbs), "shared": shared}
        )
    return out


def _load(model_dir: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
    )


def _rng_draw() -> list[float]:
    return torch.rand(3).tolist() + np.random.rand(3).tolist() + [random.random()]


def _nan_step(model: torch.nn.Module, opt: torch.optim.Optimizer, world: int, rank: int) -> bool:
    """A step whose loss is NaN on the last rank only (a NaN advantage on a trained token, injected past the
    intake's validation)."""
    config = _config("decoupled_ppo", "token-mean")
    seqs, temps = make_sequences(12, seed=50)
    mbs, mb_temps, normaliser = rank_inputs(seqs, temps, config, world, rank)
    if rank == world - 1:
        mb = next(m for m in mbs if m.loss_tokens > 0)
        row, col = (mb.loss_mask > 0).nonzero()[0].tolist()
        mb.advantages[row, col] = float("nan")
    return train_step(model, opt, mbs, mb_temps, config, normaliser, learner_version=0).applied


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = init_distributed(timeout_s=60, threads=1)
    model = shard_model(_load(model_dir), info.device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    steps = _run_steps(model, opt, world, rank)
    trained = dict(full_parameters(model))

    nan_applied = _nan_step(model, opt, world, rank)
    after_nan = dict(full_parameters(model))

    # checkpoint, draw, diverge (weights, momentum and RNG), restore, draw again
    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)
    manager = CheckpointManager(Path(out) / "ckpt")
    manager.save(model, opt, CheckpointMeta(step=len(STEPS), policy_version=len(STEPS)))
    momentum = [opt.state[p]["momentum_buffer"].full_tensor().clone() for p in model.parameters()]
    drawn_after_save = _rng_draw()
    _run_steps(model, opt, world, rank)
    drawn_diverged = _rng_draw()
    manager.load(manager.latest(), model, opt)
    restored = dict(full_parameters(model))
    restored_momentum = [opt.state[p]["momentum_buffer"].full_tensor() for p in model.parameters()]
    drawn_after_load = _rng_draw()
    torch.save(
        {"steps": steps, "trained": trained, "nan_applied": nan_applied, "after_nan": after_nan,
         "restored": restored, "momentum_equal": all(torch.equal(a, b) for a, b in zip(momentum, restored_momentum, strict=True)),
         "rng": (drawn_after_save, drawn_diverged, drawn_after_load)},
        Path(out) / f"rank{rank}.pt",
    )  # fmt: skip
    dist.destroy_process_group()


def _reference(model_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same steps in this process: no process group, no FSDP, every micro-batch of the whole batch."""
    torch.set_num_threads(1)
    model = _load(model_dir)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    steps = _run_steps(model, opt, world=1, rank=0)
    return steps, initial, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fsdp_two_ranks_match_single_process_and_restore_rng(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    model_dir = init_tiny_model(tmp_path / "model")
    mp.spawn(_worker, args=(2, free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref_steps, initial, ref_params = _reference(model_dir)

    # the batches really were split: each rank ran fewer micro-batches than the single process
    for k, ref in enumerate(ref_steps):
        assert ref["applied"] and all(r["steps"][k]["applied"] for r in ranks)
        assert all(r["steps"][k]["mbs"] < ref["mbs"] for r in ranks), k
        assert (ref["shared"] > 0) == (STEPS[k][2] > 1), k  # grouped samples ran as shared rows
        for r in ranks:
            assert r["steps"][k]["loss"] == pytest.approx(ref["loss"], abs=1e-6), k
    moved = max(float((ref_params[n] - initial[n]).abs().max()) for n in initial)
    assert moved > 1e-3  # the comparison below is not between two untouched models
    for r in ranks:
        for name, tensor in ref_params.items():
            torch.testing.assert_close(r["trained"][name], tensor, atol=1e-5, rtol=1e-5, msg=name)

    # NaN on rank 1 only: both ranks skip, neither moves
    assert [r["nan_applied"] for r in ranks] == [False, False]
    for r in ranks:
        for name, tensor in r["trained"].items():
            assert torch.equal(r["after_nan"][name], tensor), name

    # restore: weights, momentum, and each rank's own RNG streams (torch, numpy, python)
    for r in ranks:
        for name, tensor in r["trained"].items():
            assert torch.equal(r["restored"][name], tensor), name
        assert r["momentum_equal"]
        after_save, diverged, after_load = r["rng"]
        assert after_load == after_save and diverged != after_save
    assert ranks[0]["rng"][0] != ranks[1]["rng"][0]  # per-rank files, not one state for all
