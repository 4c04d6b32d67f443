"""Activation checkpointing and bf16 mixed precision under FSDP2: 2 real gloo ranks against one plain fp32
process without either, on the step batches of test_learner_fsdp (shared prompt rows included).

- Checkpointing changes nothing but memory: same losses and updated weights to fp32 noise; every decoder layer
  really runs again inside backward; checkpoints and exports carry plain Hugging Face names (a checkpoint written
  with it loads into a model without it).
- bf16 agrees within a bf16 tolerance, and really ran in bf16: the layers saw bf16 weights and inputs, the loss
  got fp32 outputs, master weights and optimizer state stayed fp32, and the update differs from fp32 by far
  more than fp32 noise.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import learner.step
from broker.server import free_port
from learner.checkpoint import CheckpointManager, CheckpointMeta, export_hf
from learner.config import LearnerConfig
from learner.distributed import (
    compute_dtype,
    decoder_layers,
    full_parameters,
    init_distributed,
    shard_model,
)
from rollout_fleet.model import init_tiny_model
from tests.test_learner_fsdp import LR, MOMENTUM, STEPS, _load, _run_steps

pytestmark = pytest.mark.timeout(180)

WRAPPER = "_checkpoint_wrapped_module"


class LayerProbe:
    """Counts decoder-layer forwards outside and inside backward (a recompute), and records the dtypes the
    layers computed in and the dtype of the log-probs the policy loss was given."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: Counter[str] = Counter()
        self.weight_dtypes: set[str] = set()
        self.input_dtypes: set[str] = set()
        self.logp_dtypes: set[str] = set()
        for layer in decoder_layers(model):
            inner = getattr(layer, WRAPPER, layer)
            inner.register_forward_pre_hook(self._layer)

    def _layer(self, module: nn.Module, args: tuple) -> None:
        # -1 outside any backward pass; a graph task id while autograd replays a checkpointed region
        self.calls["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
        self.weight_dtypes.add(str(module.self_attn.q_proj.weight.dtype))
        self.input_dtypes.add(str(args[0].dtype))

    def watch_loss_inputs(self) -> None:
        """Record the dtype of ``logp_new`` at every policy-loss call of this process (a pass-through spy)."""
        original = learner.step.compute_policy_loss

        def spy(logp: torch.Tensor, *args: object, **kwargs: object) -> object:
            self.logp_dtypes.add(str(logp.dtype))
            return original(logp, *args, **kwargs)

        learner.step.compute_policy_loss = spy


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, ac: bool, precision: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = init_distributed(timeout_s=60, threads=1)
    model = shard_model(_load(model_dir), info.device, activation_checkpointing=ac, mixed_precision=precision)
    probe = LayerProbe(model)
    probe.watch_loss_inputs()  # a spawned rank: the spy lives and dies with this process
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    steps = _run_steps(model, opt, world, rank)
    result = {
        "steps": steps,
        "trained": dict(full_parameters(model)),
        "raw_names": [n for n, _ in model.named_parameters()],
        "calls": dict(probe.calls),
        "weight_dtypes": probe.weight_dtypes,
        "input_dtypes": probe.input_dtypes,
        "logp_dtypes": probe.logp_dtypes,
        "master_dtypes": {str(p.dtype) for p in model.parameters()},
        "state_dtypes": {str(s["momentum_buffer"].dtype) for s in opt.state.values()},
        "layers": len(decoder_layers(model)),
    }
    if ac:
        result["state_dict_keys"] = list(get_model_state_dict(model))
        manager = CheckpointManager(Path(out) / "ckpt")
        manager.save(model, opt, CheckpointMeta(step=len(STEPS), policy_version=len(STEPS)))
        export_hf(model, Path(model_dir), Path(out) / "export")
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _spawn(tmp_path: Path, model_dir: Path, ac: bool, precision: str) -> list[dict]:
    assert not dist.is_initialized()
    mp.spawn(
        _worker, args=(2, free_port(), str(model_dir), str(tmp_path), ac, precision), nprocs=2, join=True
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], dict, dict]:
    """(model dir, per-step results, initial and trained weights) of one plain fp32 process without AC."""
    model_dir = init_tiny_model(tmp_path_factory.mktemp("model") / "m")
    torch.set_num_threads(1)
    model = _load(model_dir)
    probe = LayerProbe(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = _run_steps(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), world=1, rank=0)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the probe tells a recompute apart: without checkpointing no layer runs inside backward
    assert probe.calls == {"forward": len(decoder_layers(model)) * sum(s["mbs"] for s in steps)}
    moved = max(float((trained[n] - initial[n]).abs().max()) for n in initial)
    assert moved > 1e-2  # the comparisons below are not between two untouched models
    return model_dir, steps, initial, trained


def _micro_batches(rank: dict) -> int:
    return sum(s["mbs"] for s in rank["steps"])


def test_activation_checkpointing_two_ranks_match_one_process_and_recompute(
    tmp_path: Path, reference: tuple
) -> None:
    model_dir, ref_steps, _, ref_params = reference
    ranks = _spawn(tmp_path, model_dir, ac=True, precision="off")

    for r in ranks:
        assert any(WRAPPER in n for n in r["raw_names"])  # the layers really are wrapped
        for k, ref in enumerate(ref_steps):
            assert r["steps"][k]["applied"]
            assert r["steps"][k]["loss"] == pytest.approx(ref["loss"], abs=1e-6), k
        assert set(r["trained"]) == set(ref_params)  # plain HF names from full_parameters
        for name, tensor in ref_params.items():
            torch.testing.assert_close(r["trained"][name], tensor, atol=1e-5, rtol=1e-5, msg=name)
        # each layer ran once per micro-batch in forward and once more inside backward: the recompute
        forwards = r["layers"] * _micro_batches(r)
        assert r["calls"] == {"forward": forwards, "backward": forwards}
        assert r["weight_dtypes"] == r["logp_dtypes"] == {"torch.float32"}

    # state dicts, DCP checkpoints and exports name parameters as Hugging Face does
    keys = ranks[0]["state_dict_keys"]
    assert keys and not [k for k in keys if WRAPPER in k]
    trained = ranks[0]["trained"]
    plain = _load(model_dir)
    opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=MOMENTUM)
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.load(manager.latest(), plain, opt)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
    exported = _load(tmp_path / "export")
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name


def test_bf16_two_ranks_agree_with_fp32_one_process_and_really_run_bf16(
    tmp_path: Path, reference: tuple
) -> None:
    model_dir, ref_steps, initial, ref_params = reference
    ranks = _spawn(tmp_path, model_dir, ac=True, precision="bf16")  # both on, as a long run uses them
    for r in ranks:
        # the layers computed in bf16; master weights, optimizer state and the loss's log-probs stayed fp32
        assert r["weight_dtypes"] == r["input_dtypes"] == {"torch.bfloat16"}
        assert r["logp_dtypes"] == {"torch.float32"}
        assert r["master_dtypes"] == r["state_dtypes"] == {"torch.float32"}
        for k, ref in enumerate(ref_steps):
            assert r["steps"][k]["applied"]
            assert r["steps"][k]["loss"] == pytest.approx(ref["loss"], rel=2e-3), k
        moved = max(float((ref_params[n] - initial[n]).abs().max()) for n in initial)
        diff = max(float((r["trained"][n] - ref_params[n]).abs().max()) for n in ref_params)
        # within bf16 rounding of an update of size `moved`, and far outside fp32 noise (about 1e-8 here)
        assert 1e-5 < diff < 0.1 * moved, (diff, moved)
    # the ranks hold one model: the same gathered weights on both
    for name, tensor in ranks[0]["trained"].items():
        assert torch.equal(ranks[1]["trained"][name], tensor), name


def test_mixed_precision_choice_and_refusal() -> None:
    cpu = torch.device("cpu")
    assert compute_dtype("auto", cpu) is None  # fp32 on CPU unless asked
    assert compute_dtype("off", cpu) is None
    assert compute_dtype("bf16", cpu) is torch.bfloat16
    assert LearnerConfig(mixed_precision="bf16").mixed_precision == "bf16"
    with pytest.raises(ValueError, match="mixed_precision"):
        LearnerConfig(mixed_precision="fp16")
