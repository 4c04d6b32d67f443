"""LoRA adapters synced to a real SGLang server on a GPU (needs the ``streamrl[sglang]`` extra; ``gpu``, deselected
in CI): SGLang's own LoRA path (``weight_sync.lora_sync = adapter_path``: a PEFT adapter directory,
``/load_lora_adapter``, ``/update_weight_version``), then requests that carry the versioned ``lora_path`` get the
learner's merged model's log-probs (bf16 on the GPU, so a looser tolerance than on CPU) over two versions, the
oldest adapter unloaded; and the adapter broadcast (``lora_sync = adapter``), which SGLang has no endpoint for,
fails fast with a 404 instead of hanging the learner."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from broker.server import free_port
from tests.test_weight_sync_e2e import SEQUENCE, http_json

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def _logprobs(model: torch.nn.Module) -> list[float]:
    with torch.no_grad():
        ids = torch.tensor([SEQUENCE], device=next(model.parameters()).device)
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        return logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()


def _served(url: str, lora_path: str | None) -> list[float]:
    body = {"input_ids": SEQUENCE, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "lora_path": lora_path}  # fmt: skip
    meta = http_json(url + "/generate", body, timeout=120)["meta_info"]
    return [lp for lp, _, _ in meta["input_token_logprobs"][1:]]


def _learner(rank: int, port: int, model_dir: str, url: str, out: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers import AutoModelForCausalLM

    from learner.config import LoraSection
    from learner.distributed import init_distributed, shard_model
    from learner.lora import apply_lora
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender, sync_weights

    info = init_distributed(timeout_s=120, threads=1)
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoraSection(rank=8, alpha=16))
    model = shard_model(model.to(info.device), info.device)
    cfg = WeightSyncConfig(timeout_s=60, adapter_dir=str(Path(out).parent / "adapters"), keep_adapters=1)
    sender = WeightSender([url], cfg)
    sender.connect()
    report: dict = {"base": _logprobs(model), "versions": []}
    for version in (1, 2):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0.0, 0.05)
        result = sync_weights(model, version, sender, lora_sync="adapter_path")
        report["versions"].append({"ok": result.engines_ok, "failed": result.engines_failed,
                                   "learner": _logprobs(model), "name": cfg.adapter_name(version)})  # fmt: skip
    sender.quarantined.clear()
    broadcast = sync_weights(model, 3, sender, lora_sync="adapter")  # SGLang has no distributed adapter load
    report["broadcast_failed"] = broadcast.engines_failed
    sender.close()
    Path(out).write_text(json.dumps(report))


async def test_sglang_serves_the_synced_adapter_by_versioned_lora_path(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from broker.client import connect
    from broker.config import BrokerConfig, RedisServerConfig
    from broker.registry import EngineRegistry
    from broker.server import EmbeddedRedis
    from common.config import SharedConfig
    from rollout_fleet.config import EngineConfig
    from rollout_fleet.fleet import Fleet
    from rollout_fleet.model import init_tiny_model

    model_dir = init_tiny_model(tmp_path / "tiny")
    shared = SharedConfig(run_id="lora", model_path=model_dir, run_dir=tmp_path / "run", http_timeout_s=30.0)
    extra = ["--disable-cuda-graph", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
             "--max-loras-per-batch", "2", "--max-loaded-loras", "4"]  # fmt: skip
    engine = EngineConfig(kind="sglang", count=1, mem_fraction_static=0.2, max_context_len=512,
                          launch_timeout_s=600.0, extra_args=extra)  # fmt: skip
    redis_server = EmbeddedRedis(tmp_path / "redis", RedisServerConfig())
    redis_server.start()
    client = connect(redis_server.url, BrokerConfig())
    fleet = Fleet(shared, engine, EngineRegistry(client, shared), ports=[free_port()])
    try:
        (url,) = await fleet.start()
        out = tmp_path / "out.json"
        mp.start_processes(_learner, args=(free_port(), str(model_dir), url, str(out)), nprocs=1,
                           start_method="spawn")  # fmt: skip
        report = json.loads(out.read_text())
        base_gap = max(abs(a - b) for a, b in zip(_served(url, None), report["base"], strict=True))
        assert base_gap < 0.05  # no lora_path: the base model
        for seen in report["versions"]:
            assert seen["ok"] == [url] and not seen["failed"], seen
        latest = report["versions"][-1]
        served = _served(url, latest["name"])
        gap = max(abs(a - b) for a, b in zip(served, latest["learner"], strict=True))
        moved = max(abs(a - b) for a, b in zip(latest["learner"], report["base"], strict=True))
        assert gap < 0.05 < moved, (gap, moved)
        assert http_json(url + "/model_info")["weight_version"] == "2"
        assert url in report["broadcast_failed"] and "404" in report["broadcast_failed"][url]
    finally:
        await fleet.stop()
        await client.aclose()
        redis_server.stop()
