"""LoRA served by adapter name (``weight_sync.lora_sync = adapter_path``, SGLang's way) through a whole
``streamrl up`` on the built-in engines, which refuse a ``lora_path`` naming an adapter they have not loaded as
SGLang does: every rollout request must name the published version's adapter (none at version 0, the base)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_fleet.workflows.session import EngineSession
from tests.test_up import metrics_base_port, up
from weight_sync.config import WeightSyncConfig


def test_requests_name_the_published_versions_adapter() -> None:
    names = WeightSyncConfig().adapter_name
    payload = {"input_ids": [1, 2], "rid": "g:s0:r0"}
    for version, expected in ((0, None), (1, "policy-v1"), (7, "policy-v7")):
        worker = SimpleNamespace(adapter_name=names, versions=SimpleNamespace(value=version))
        got = EngineSession.select_adapter(worker, payload)  # type: ignore[arg-type]
        assert got.get("lora_path") == expected
        assert {k: v for k, v in got.items() if k != "lora_path"} == payload
    plain = SimpleNamespace(adapter_name=None, versions=SimpleNamespace(value=3))
    assert EngineSession.select_adapter(plain, payload) == payload  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_trains_lora_served_by_adapter_name(tmp_path: Path) -> None:
    from streamrl.warm_start import init_warm_model

    run = tmp_path / "run"
    proc = up(
        run, init_warm_model(), metrics_base_port(), "--learner.max_steps=8", "--learner.lora.rank=8",
        "--learner.lr=1e-3", "--weight_sync.lora_sync=adapter_path", f"--weight_sync.adapter_dir={run / 'ad'}",
        "--learner.wandb_mode=disabled", "--eval.every_versions=1000000",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=540)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["eval_after_is_final_policy"]
    assert "not loaded" not in (run / "logs" / "rollout-0.log").read_text()
    assert sorted(p.name for p in (run / "ad").iterdir())[-1].startswith("policy-v")
