"""A non-finite loss or gradient skips the optimizer step (weights and optimizer state untouched), reports it,
and leaves the model able to train the next step. Single process, real model, real AdamW."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from learner.attention import register_packed_attention
from learner.config import LearnerConfig
from learner.step import train_step
from rollout_fleet.model import init_tiny_model
from tests.learner_batch import make_sequences, rank_inputs

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("nonfinite") / "model")


def _setup(model_dir: Path):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = LearnerConfig(micro_batch_tokens=64)
    seqs, temps = make_sequences(6, seed=3)
    mbs, mb_temps, normaliser = rank_inputs(seqs, temps, config, world_size=1, rank=0)
    return model, opt, config, mbs, mb_temps, normaliser


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_skipped_then_trains(model, opt, config, mbs, mb_temps, normaliser, result) -> None:  # noqa: ANN001
    before = result
    assert not before["result"].applied
    for name, tensor in _snapshot(model).items():
        assert torch.equal(tensor, before["params"][name]), name
    assert opt.state == {}  # AdamW never stepped: no moments, no step count
    assert all(p.grad is None for p in model.parameters())  # the bad gradient is not carried over
    clean = [copy.deepcopy(mb) for mb in before["clean"]]
    ok = train_step(model, opt, clean, mb_temps, config, normaliser, learner_version=0)
    assert ok.applied and torch.isfinite(torch.tensor(ok.metrics["loss"]))
    assert any(not torch.equal(p.detach(), before["params"][n]) for n, p in model.named_parameters())


def test_nan_advantage_skips_the_step(model_dir: Path) -> None:
    model, opt, config, mbs, mb_temps, normaliser = _setup(model_dir)
    clean = [copy.deepcopy(mb) for mb in mbs]
    params = _snapshot(model)
    row, col = (mbs[0].loss_mask > 0).nonzero()[0].tolist()
    mbs[0].advantages[row, col] = float("nan")  # past the intake's validation, as a tensor
    result = train_step(model, opt, mbs, mb_temps, config, normaliser, learner_version=0)
    assert result.metrics["loss"] != result.metrics["loss"]  # NaN, reported
    _assert_skipped_then_trains(
        model, opt, config, mbs, mb_temps, normaliser, {"result": result, "params": params, "clean": clean}
    )


def test_infinite_gradient_with_finite_loss_skips_the_step(model_dir: Path) -> None:
    model, opt, config, mbs, mb_temps, normaliser = _setup(model_dir)
    clean = [copy.deepcopy(mb) for mb in mbs]
    params = _snapshot(model)
    # the one fault that cannot be produced for real on demand: a gradient overflow in a finite loss
    weight = model.model.layers[0].mlp.down_proj.weight
    handle = weight.register_hook(lambda g: torch.where(g == g.flatten()[0], torch.inf, g))
    result = train_step(model, opt, mbs, mb_temps, config, normaliser, learner_version=0)
    handle.remove()
    assert torch.isfinite(torch.tensor(result.metrics["loss"]))
    assert result.grad_norm == float("inf") or result.grad_norm != result.grad_norm
    _assert_skipped_then_trains(
        model, opt, config, mbs, mb_temps, normaliser, {"result": result, "params": params, "clean": clean}
    )
