"""LoRA without processes: config errors name the field and the value; the engine-side applier serves
W_base + s * B @ A per version (never the sum of versions), resets on a full load, refuses bad tensors before
changing anything; the wire protocol and the PEFT adapter directory round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.configlib import ConfigError, build_config, render_help
from learner.config import LearnerConfig, LoraSection
from weight_sync import protocol
from weight_sync.buckets import TensorMeta
from weight_sync.lora import (
    AdapterApplier,
    LoraSpec,
    iter_adapter_tensors,
    iter_merged_tensors,
    lora_spec,
    read_peft_adapter,
    write_peft_adapter,
)


def test_bad_rank_names_the_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"lora\.rank = -1"):
        build_config(LearnerConfig, {"lora": {"rank": -1}})


def test_malformed_target_module_names_the_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"target_modules = \['q-proj'\]"):
        build_config(LearnerConfig, {"lora": {"rank": 4, "target_modules": ["q-proj"]}})


def test_unknown_target_module_names_the_field_value_and_the_choices(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from learner.lora import apply_lora
    from rollout_fleet.model import init_tiny_model

    model = AutoModelForCausalLM.from_pretrained(init_tiny_model(tmp_path / "m"))
    section = LoraSection(rank=4, target_modules=["q_proj", "qq_proj"])
    with pytest.raises(ConfigError, match=r"learner\.lora\.target_modules = \['q_proj', 'qq_proj'\]") as err:
        apply_lora(model, section)
    assert "['qq_proj']" in str(err.value) and "down_proj" in str(err.value)
    assert not any("lora" in n for n, _ in model.named_parameters())  # refused before anything changed


def test_lora_is_off_by_default_and_documented() -> None:
    assert not LearnerConfig().lora.enabled
    text = render_help(LearnerConfig)
    for field in ("lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules"):
        assert field in text


def _linear_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"m.q.weight": torch.randn(6, 5, generator=gen), "m.o.weight": torch.randn(5, 6, generator=gen)}


def _adapter(seed: int, r: int = 2) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("m.q.lora_A.weight", torch.randn(r, 5, generator=gen)),
        ("m.q.lora_B.weight", torch.randn(6, r, generator=gen)),
        ("m.o.lora_A.weight", torch.randn(r, 6, generator=gen)),
        ("m.o.lora_B.weight", torch.randn(5, r, generator=gen)),
    ]


def test_applier_serves_each_version_from_the_base_not_on_top_of_the_last() -> None:
    params = _linear_params()
    base = {k: v.clone() for k, v in params.items()}
    applier = AdapterApplier(params)
    spec = LoraSpec(r=2, lora_alpha=4.0, target_modules=("o", "q"), scaling=2.0)
    for seed in (1, 2):
        named = _adapter(seed)
        assert applier.apply(named[:1], spec) == 0  # A alone waits for B (an adapter split over buckets)
        assert applier.apply(named[1:], spec) == 2
        t = dict(named)
        for layer in ("m.q", "m.o"):
            want = base[f"{layer}.weight"] + 2.0 * t[f"{layer}.lora_B.weight"] @ t[f"{layer}.lora_A.weight"]
            torch.testing.assert_close(params[f"{layer}.weight"], want)
    with pytest.raises(ValueError, match=r"m\.q\.lora_A\.weight.*shape \[3, 5\]"):
        applier.apply([("m.q.lora_A.weight", torch.zeros(3, 5))], spec)
    with pytest.raises(KeyError, match="no linear layer 'm.k'"):
        applier.apply([("m.k.lora_A.weight", torch.zeros(2, 5))], spec)
    applier.unload()
    assert all(torch.equal(params[k], base[k]) for k in base)
    # a full load makes new weights the base: the next adapter goes on top of them
    params["m.q.weight"].copy_(torch.ones(6, 5))
    applier.forget(["m.q.weight"])
    applier.apply(_adapter(3), spec)
    t = dict(_adapter(3))
    torch.testing.assert_close(
        params["m.q.weight"], 1 + 2.0 * t["m.q.lora_B.weight"] @ t["m.q.lora_A.weight"]
    )


def test_protocol_and_peft_directory_round_trip(tmp_path: Path) -> None:
    spec = LoraSpec(r=2, lora_alpha=4.0, target_modules=("o", "q"), scaling=2.0)
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in _adapter(1)]
    body = protocol.lora_distributed_body(metas, "policy-v3", spec, weight_version="3")
    parsed = protocol.parse_lora_distributed(body)
    assert parsed.adapter == spec and parsed.lora_name == "policy-v3" and parsed.weight_version == "3"
    assert [m.name for m in parsed.metas] == [m.name for m in metas]
    with pytest.raises(ValueError, match="config_dict"):
        protocol.parse_lora_distributed({k: v for k, v in body.items() if k != "config_dict"})
    # the full-weight route ignores the LoRA fields
    assert protocol.parse_update_distributed(body).adapter is None

    path = write_peft_adapter(tmp_path / "policy-v3", _adapter(1), spec)
    named, read = read_peft_adapter(path)
    assert read == spec
    assert sorted((n, t.tolist()) for n, t in named) == sorted((n, t.tolist()) for n, t in _adapter(1))
    from safetensors.torch import load_file

    assert all(
        k.startswith("base_model.model.m.") for k in load_file(str(path / "adapter_model.safetensors"))
    )


def test_learner_side_tensors_of_a_peft_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from learner.lora import apply_lora, merged_state_dict
    from rollout_fleet.model import init_tiny_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(init_tiny_model(tmp_path / "m"))
    assert lora_spec(model) is None
    model = apply_lora(model, LoraSection(rank=2, alpha=6, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    spec = lora_spec(model)
    assert spec == LoraSpec(r=2, lora_alpha=6.0, target_modules=("down_proj", "q_proj"), scaling=3.0)
    sent = dict(iter_adapter_tensors(model))
    assert len(sent) == 2 * 2 * 4 and "model.layers.3.mlp.down_proj.lora_B.weight" in sent
    merged = dict(iter_merged_tensors(model))
    state = merged_state_dict(model, {k: v.detach() for k, v in model.state_dict().items()})
    assert merged.keys() == {k for k in state if k != "lm_head.weight"} | ({"lm_head.weight"} & merged.keys())
    q = model.model.layers[0].self_attn.q_proj
    want = q.base_layer.weight + 3.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], want.detach())
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"], want.detach())
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.bias"], q.base_layer.bias.detach())
