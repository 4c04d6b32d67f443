"""Snapshots and the learner's exports are bounded like checkpoints: real HF directories written by the learner's
own methods (single process, tiny model), the oldest pruned first, never the one just written nor the newest, and
never an export `streamrl export` made on request."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from common.config import SharedConfig
from learner.config import LearnerConfig
from learner.trainer import Learner
from rollout_fleet.model import init_tiny_model


def names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_snapshots_and_exports_keep_the_newest_and_prune_the_oldest_first(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model_dir = init_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    learner = SimpleNamespace(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        shared=SharedConfig(run_dir=run, model_path=model_dir),
        config=LearnerConfig(keep_snapshots=2, keep_exports=2),
        info=SimpleNamespace(is_main=True),
        intake=SimpleNamespace(sample_totals={}),
    )
    # what `streamrl export --step 1` wrote: never the learner's to prune
    offline = run / "export" / "step-000001"
    offline.mkdir(parents=True)
    (offline / "export.json").write_text(json.dumps({"step": 1, "source": "checkpoint"}))

    def at(step: int) -> None:
        learner.step = learner.version = step
        Learner._snapshot(learner)
        Learner._export(learner)

    for step in (2, 3, 4, 5):
        at(step)
    assert names(run / "snapshots") == ["step-000004", "step-000005"]
    assert all((run / "snapshots" / n / "model.safetensors").is_file() for n in names(run / "snapshots"))
    assert names(run / "export") == ["latest", "step-000001", "step-000004"]
    assert json.loads((run / "export" / "latest" / "export.json").read_text())["step"] == 5
    assert (run / "export" / "step-000004" / "model.safetensors").is_file()
    # a learner resumed from an older checkpoint writes step 3 again: it stays (it is the one being written), the
    # oldest of the others goes, and the bound holds
    at(3)
    assert names(run / "snapshots") == ["step-000003", "step-000005"]
    assert names(run / "export") == ["latest", "step-000001", "step-000005"]
    # the default keeps one export, as before there was a choice: latest alone, replaced
    learner.config = LearnerConfig(keep_snapshots=2)
    at(6)
    assert names(run / "export") == ["latest", "step-000001"]
    assert json.loads((run / "export" / "latest" / "export.json").read_text())["step"] == 6
