"""Checkpoints over 2 real gloo ranks: save, restore bit-exact, prune, HF export loadable by transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from broker.server import free_port
from learner.checkpoint import (
    CheckpointManager,
    CheckpointMeta,
    LedgerEntry,
    checkpoint_of_step,
    export_checkpoint,
    export_hf,
)
from learner.distributed import full_parameters, init_distributed, shard_model
from rollout_fleet.model import init_tiny_model


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (2, 12), generator=gen)
    loss = model(input_ids=ids).logits.log_softmax(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers import AutoModelForCausalLM

    info = init_distributed(timeout_s=60, threads=1)
    model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir), info.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(Path(out) / "ckpt", keep_last=3)
    for step in range(1, 4):
        _train_step(model, opt, seed=step)
        ledger = [LedgerEntry(f"{step}-0", f"g{step}", "trained")]
        manager.save(model, opt, CheckpointMeta(step=step, policy_version=step + 10, ledger=ledger))
    saved = {n: t.clone() for n, t in full_parameters(model)}
    writer_group = dist.new_group(backend="gloo")
    # a background save, polled as the learner polls, as often as possible while the writer thread runs its own
    # collectives: a poll over the writer's group deadlocked (each rank paired the two threads' collectives
    # differently); over the training group it cannot
    pending = manager.save_async(model, opt, CheckpointMeta(step=4, policy_version=14), writer_group)
    uncommitted = sorted(p.name for p in (Path(out) / "ckpt").iterdir())
    polls = 1
    while not manager.all_written(pending):
        polls += 1
    manager.finish(pending)
    # another: staged now, written while the next step changes the weights, committed after
    pending = manager.save_async(model, opt, CheckpointMeta(step=5, policy_version=15), writer_group)
    _train_step(model, opt, seed=4)
    async_path = manager.finish(pending)
    manager.load(async_path, model, opt)
    async_restored = dict(full_parameters(model))
    _train_step(model, opt, seed=99)  # diverge, then restore
    meta = manager.load(Path(out) / "ckpt" / "step_00000003", model, opt)
    restored = dict(full_parameters(model))
    first = next(iter(model.parameters()))
    adam_steps = float(opt.state[first]["step"])  # 4 before the restore, 3 in the checkpoint
    _train_step(model, opt, seed=7)
    after_restore = dict(full_parameters(model))
    export_hf(model, Path(model_dir), Path(out) / "export")
    if rank == 0:
        torch.save(
            {"saved": saved, "restored": restored, "after": after_restore, "step": meta.step,
             "version": meta.policy_version, "adam_steps": adam_steps, "ledger": [e.group_id for e in meta.ledger],
             "uncommitted": uncommitted, "async_restored": async_restored, "polls": polls},
            Path(out) / "result.pt",
        )  # fmt: skip
    dist.destroy_process_group()


def test_checkpoint_restore_prune_and_export(tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "model")
    mp.spawn(_worker, args=(2, free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["adam_steps"] == 3.0
    assert result["step"] == 3 and result["version"] == 13 and result["ledger"] == ["g3"]
    for name, tensor in result["saved"].items():
        assert torch.equal(tensor, result["restored"][name]), name
        # the background save holds the weights it was started with, not the step taken while it was written
        assert torch.equal(tensor, result["async_restored"][name]), name
    assert result["polls"] >= 1
    assert result["uncommitted"] == [
        "LATEST", "step_00000001", "step_00000002", "step_00000003", "step_00000004.tmp",
    ]  # fmt: skip
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["LATEST", "step_00000003", "step_00000004", "step_00000005"]

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    for name, tensor in exported.named_parameters():
        assert torch.equal(tensor.detach(), result["after"][name]), name

    # offline, in this process with no process group: the newest checkpoint's policy (step 3), bit for bit
    offline = export_checkpoint(checkpoint_of_step(tmp_path / "ckpt", 3), model_dir, tmp_path / "offline")
    from_checkpoint = AutoModelForCausalLM.from_pretrained(offline)
    for name, tensor in from_checkpoint.named_parameters():
        assert torch.equal(tensor.detach(), result["saved"][name]), name
    assert checkpoint_of_step(tmp_path / "ckpt", None).name == "step_00000005"
    with pytest.raises(ValueError, match=r"step = 1: .*there are \[3, 4, 5\]"):
        checkpoint_of_step(tmp_path / "ckpt", 1)
