"""Sharded loading (learner.loading) on real gloo ranks: every rank reads only the rows it owns, and the model it
builds is the one the whole-model path builds (same parameters, buffers and logits), with activation
checkpointing, with LoRA adapters, with its shards offloaded, and from a directory of several safetensors
files; a directory that does not match the architecture is refused with the tensor named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from broker.server import free_port
from common.configlib import ConfigError
from learner.attention import register_packed_attention
from learner.config import LoraSection
from learner.distributed import full_parameters, init_distributed, shard_model
from learner.loading import load_sharded, read_rows, stored_tensors
from rollout_fleet.model import init_tiny_model

pytestmark = pytest.mark.timeout(180)

WORLD = 2
INPUT = torch.tensor([[1, 5, 9, 14, 3, 22, 7, 30, 2, 11]])  # token ids of the tiny character vocabulary


def _whole_model(model_dir: str, device: torch.device, **shard_kwargs: object) -> torch.nn.Module:
    """Today's path before sharded loading: the whole model in fp32 on every rank, then FSDP2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
    )
    return shard_model(model, device, **shard_kwargs)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits.detach().clone()


def _worker(
    rank: int, world: int, port: int, model_dir: str, sharded_dir: str, broken_dir: str, out: str
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = init_distributed(timeout_s=60, threads=1)
    attention = register_packed_attention()
    result: dict[str, object] = {}

    whole = _whole_model(model_dir, info.device)
    result["whole"] = {"params": dict(full_parameters(whole)), "logits": _logits(whole)}
    result["buffers"] = {n: b.clone() for n, b in whole.named_buffers()}
    del whole

    cases = {
        "plain": dict(model_path=Path(model_dir)),
        "several_files": dict(model_path=Path(sharded_dir)),
        "checkpointed": dict(model_path=Path(model_dir), activation_checkpointing=True),
        "offload": dict(model_path=Path(model_dir), offload=True),
        "lora": dict(model_path=Path(model_dir), lora=LoraSection(rank=4, alpha=8.0), seed=3),
    }
    for name, kwargs in cases.items():
        model, report = load_sharded(device=info.device, attention=attention, **kwargs)
        result[name] = {
            "params": dict(full_parameters(model)),
            "lora_params": {
                n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if ".lora_" in n
            },
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "logits": _logits(model),
            "report": report,
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        }
        del model
    try:
        load_sharded(Path(broken_dir), info.device, attention=attention)
        result["broken"] = None
    except ConfigError as exc:
        result["broken"] = str(exc)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("loading")
    model_dir = init_tiny_model(tmp / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.save_pretrained(tmp / "sharded", max_shard_size="300KB")  # several files and an index
    broken = tmp / "broken"  # one decoder tensor renamed: the directory no longer matches config.json
    model.save_pretrained(broken)
    _rename_tensor(
        broken / "model.safetensors", "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up.weight"
    )
    mp.spawn(
        _worker,
        args=(WORLD, free_port(), str(model_dir), str(tmp / "sharded"), str(broken), str(tmp)),
        nprocs=WORLD,
        join=True,
    )
    return model_dir, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _rename_tensor(path: Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors[new] = tensors.pop(old)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["plain", "several_files", "checkpointed", "offload"])
def test_a_sharded_load_builds_the_model_the_whole_load_builds(
    loaded: tuple[Path, list[dict]], case: str
) -> None:
    _, ranks = loaded
    for r in ranks:
        whole, got = r["whole"], r[case]
        assert got["params"].keys() == whole["params"].keys()
        for name, tensor in whole["params"].items():
            assert torch.equal(got["params"][name], tensor), name
        assert {k.replace("_checkpoint_wrapped_module.", "") for k in got["buffers"]} == r["buffers"].keys()
        for name, buffer in got["buffers"].items():  # rotary inv_freq: computed, in no file
            assert torch.equal(buffer, r["buffers"][name.replace("_checkpoint_wrapped_module.", "")]), name
        assert torch.equal(got["logits"], whole["logits"])
        assert got["tied"]


@pytest.mark.parametrize("case", ["plain", "several_files", "lora"])
def test_each_rank_reads_only_the_rows_it_owns(loaded: tuple[Path, list[dict]], case: str) -> None:
    model_dir, ranks = loaded
    stored = stored_tensors(model_dir)
    total = sum(s.end - s.start for s in stored.values())
    largest = max(s.end - s.start for s in stored.values())
    reports = [r[case]["report"] for r in ranks]
    assert all(rep.stored_bytes == total for rep in reports)
    # together the ranks read the directory once; apart, each about its share (uneven rows round up)
    assert sum(rep.bytes_read for rep in reports) == total
    for rep in reports:
        assert rep.bytes_read <= total / WORLD + 0.02 * total, (rep.bytes_read, total)
        assert rep.largest_read <= largest / WORLD + max(s.row_bytes for s in stored.values())


def test_lora_adapters_start_as_peft_starts_them_and_leave_the_model_unchanged(
    loaded: tuple[Path, list[dict]],
) -> None:
    _, ranks = loaded
    for r in ranks:
        adapters = r["lora"]["lora_params"]
        a = [t for n, t in adapters.items() if ".lora_A." in n]
        b = [t for n, t in adapters.items() if ".lora_B." in n]
        assert a and len(a) == len(b)
        assert all(float(t.abs().max()) > 0 for t in a) and all(float(t.abs().max()) == 0 for t in b)
        for t in a:  # Kaiming-uniform with a = sqrt(5): |x| <= 1 / sqrt(fan_in)
            assert float(t.abs().max()) <= 1 / t.shape[1] ** 0.5
        assert torch.equal(r["lora"]["logits"], r["whole"]["logits"])  # B = 0: the adapted model is the base
        assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in r["lora"]["report"].initialised
    for name, tensor in ranks[0]["lora"]["lora_params"].items():
        assert torch.equal(ranks[1]["lora"]["lora_params"][name], tensor), name


def test_a_directory_that_does_not_match_the_architecture_is_refused(loaded: tuple[Path, list[dict]]) -> None:
    _, ranks = loaded
    for r in ranks:
        assert r["broken"] is not None
        assert "model.layers.1.mlp.up_proj.weight" in r["broken"]
        assert "shared.model_path" in r["broken"]


def test_read_rows_reads_a_row_range_of_every_stored_dtype(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "f32": torch.arange(24, dtype=torch.float32).reshape(6, 4),
        "bf16": torch.arange(15, dtype=torch.bfloat16).reshape(5, 3),
        "i64": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    stored = stored_tensors(tmp_path)
    assert torch.equal(read_rows(stored["f32"], 2, 3), tensors["f32"][2:5])
    assert torch.equal(read_rows(stored["bf16"], 4, 1), tensors["bf16"][4:5])
    assert torch.equal(read_rows(stored["i64"], 0, 7), tensors["i64"])
    assert read_rows(stored["f32"], 6, 0).shape == (0, 4)
    assert torch.equal(read_rows(stored["scalar"], 0, 1), tensors["scalar"])


def test_a_directory_without_weights_is_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ConfigError, match="shared.model_path"):
        stored_tensors(tmp_path)
