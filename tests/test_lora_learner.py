"""LoRA under FSDP2 with two real gloo ranks: a step equals the same step in one plain process, changes only the
adapters (the base stays bit-identical, the optimizer holds only adapters), a checkpoint resumes it exactly
(weights, Adam state, and the step after the resume), and the Hugging Face export is the merged model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from broker.server import free_port
from rollout_fleet.model import init_tiny_model

pytestmark = pytest.mark.timeout(180)
SEQUENCE = list(range(5, 45))


def _build(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from learner.config import LoraSection
    from learner.lora import apply_lora

    torch.manual_seed(0)  # as the trainer: the same adapter initialisation on every rank
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return apply_lora(model, LoraSection(rank=4, alpha=8))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum over the trainable parameters (the adapters): Adam's first step is lr * sign(grad), which
    turns a rounding difference in a near-zero gradient into a full-size one, so it cannot compare 2 ranks with
    1 process; momentum gives the checkpoint optimizer state to restore."""
    from learner.lora import trainable_parameters

    return torch.optim.SGD(trainable_parameters(model), lr=0.5, momentum=0.9)


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int, world: int = 1, rank: int = 0
) -> None:
    """One optimizer step on a fixed batch of 4 rows; each of ``world`` ranks takes its share (FSDP2 averages)."""
    ids = torch.randint(5, 90, (4, 16), generator=torch.Generator().manual_seed(seed))
    share = ids.shape[0] // world
    rows = ids[rank * share : (rank + 1) * share]
    model(input_ids=rows, labels=rows).loss.backward()
    opt.step()
    opt.zero_grad()


def _logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([SEQUENCE])
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        return logp.gather(-1, ids[0, 1:, None])[:, 0]


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from learner.checkpoint import CheckpointManager, CheckpointMeta, export_hf
    from learner.distributed import full_parameters, init_distributed, shard_model
    from learner.lora import trainable_parameters

    info = init_distributed(timeout_s=60, threads=1)
    model = shard_model(_build(model_dir), info.device)
    opt = _optimizer(model)
    initial = dict(full_parameters(model))
    _step(model, opt, seed=1, world=world, rank=rank)
    stepped = dict(full_parameters(model))
    manager = CheckpointManager(Path(out) / "ckpt")
    manager.save(model, opt, CheckpointMeta(step=1, policy_version=1))
    export_hf(model, Path(model_dir), Path(out) / "export-step1")  # online, of the checkpointed policy
    _step(model, opt, seed=2, world=world, rank=rank)
    continued = dict(full_parameters(model))
    _step(model, opt, seed=3, world=world, rank=rank)  # diverge further, then resume from step 1
    manager.load(manager.latest(), model, opt)
    restored = dict(full_parameters(model))
    _step(model, opt, seed=2, world=world, rank=rank)  # the same step 2 as before the checkpoint was left
    resumed = dict(full_parameters(model))
    logprobs = _logprobs(model)
    export_hf(model, Path(model_dir), Path(out) / "export")
    if rank == 0:
        torch.save(
            {"initial": initial, "stepped": stepped, "continued": continued, "restored": restored,
             "resumed": resumed, "logprobs": logprobs, "optimized": len(opt.param_groups[0]["params"]),
             "trainable": len(trainable_parameters(model))},
            Path(out) / "result.pt",
        )  # fmt: skip
    dist.destroy_process_group()


def test_lora_fsdp_step_checkpoint_and_merged_export(tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "model")
    mp.spawn(_worker, args=(2, free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    torch.set_num_threads(1)
    reference = _build(str(model_dir))
    opt = _optimizer(reference)
    _step(reference, opt, seed=1)
    ref = {n: p.detach() for n, p in reference.named_parameters()}

    initial, stepped = result["initial"], result["stepped"]
    adapters = {n for n in initial if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 2 * 4 * 7  # A and B of 7 projections in each of 4 layers
    assert result["optimized"] == result["trainable"] == len(adapters)  # only the adapters are optimised
    for name, tensor in stepped.items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-6, rtol=1e-5, msg=name)  # 2 ranks == 1 process
        if ".lora_B." in name:  # B starts at 0 (so A's first gradient is 0): every B learned
            assert not torch.equal(tensor, initial[name]), name
        elif name not in adapters:
            assert torch.equal(tensor, initial[name]), name  # the base (and the embeddings) never move

    # resume: the restored weights are the checkpoint's and the next step is the one taken before
    for name, tensor in stepped.items():
        assert torch.equal(result["restored"][name], tensor), name
        assert torch.equal(result["resumed"][name], result["continued"][name]), name

    # the export is a plain Hugging Face model: merged weights, no adapter tensors, the learner's log-probs
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    names = [n for n, _ in exported.named_parameters()]
    assert not any("lora" in n or "base_layer" in n for n in names)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    torch.testing.assert_close(_logprobs(exported), result["logprobs"], atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert (_logprobs(base) - result["logprobs"]).abs().max() > 1e-3  # the merge did change the model

    # offline (streamrl export's path): the checkpoint's DCP shards, merged, are the online export bit for bit
    from safetensors.torch import load_file

    from learner.checkpoint import export_checkpoint
    from learner.config import LoraSection

    offline = export_checkpoint(
        tmp_path / "ckpt" / "step_00000001", model_dir, tmp_path / "offline", LoraSection(rank=4, alpha=8)
    )
    online = load_file(str(tmp_path / "export-step1" / "model.safetensors"))
    got = load_file(str(offline / "model.safetensors"))
    assert got.keys() == online.keys() and not any("lora" in k for k in got)
    for name, tensor in online.items():
        assert torch.equal(got[name], tensor), name
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"],
        base.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
