"""A real model's shape on this machine: ``streamrl model init --shape`` builds it offline (random weights, a byte-level
BPE tokenizer trained here), and ``streamrl up`` trains it end to end.

The fast tests use the small shape (~12 M parameters, the same layout); the ``slow`` one runs Qwen2.5-0.5B's shape
(494 M parameters, vocabulary 151,936) with one engine and two learner ranks for 3 steps on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_fleet.shapes import SHAPES, build_bpe_tokenizer

pytestmark = pytest.mark.timeout(900)


def test_the_bpe_tokenizer_round_trips_any_text_and_keeps_the_chat_tokens() -> None:
    tokenizer = build_bpe_tokenizer(1024)
    for text in ("What is 12 * 34 = ?", "émoji ✓ and\nnewlines\ttabs", "<|im_start|>user\nhi<|im_end|>\n"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode("<|im_start|>assistant\n")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # one special token, not its characters
    assert len(tokenizer) <= 1024
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1"}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    assert prompt.endswith("<|im_start|>assistant\n")


def test_the_small_shape_is_built_offline_with_the_qwen_layout(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    done = subprocess.run(
        [sys.executable, "-m", "streamrl", "model", "init", "--shape", "qwen2.5-small", "--out", str(tmp_path / "m")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shape = SHAPES["qwen2.5-small"]
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (
        shape.hidden_size, shape.num_hidden_layers, shape.num_key_value_heads, shape.vocab_size,
    )  # fmt: skip
    assert config.tie_word_embeddings
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == shape.parameters()
    # the README's 0.5B figure comes from the same formula
    assert round(SHAPES["qwen2.5-0.5b"].parameters() / 1e6) == 494


@pytest.mark.slow
def test_up_trains_the_qwen25_05b_shape_for_three_steps(tmp_path: Path) -> None:
    model = tmp_path / "qwen"
    done = subprocess.run(
        [sys.executable, "-m", "streamrl", "model", "init", "--shape", "qwen2.5-0.5b", "--out", str(model)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={model}",
            "--engine.count=1", "--learner.world_size=2", "--learner.max_steps=3", "--learner.groups_per_step=2",
            "--rollout.group_size=2", "--rollout.max_new_tokens=16", "--learner.micro_batch_tokens=512",
            "--eval.every_versions=0", "--eval.heldout_prompts=2", "--eval.max_new_tokens=8",
            "--eval.samples_per_prompt=1", "--learner.wandb_mode=disabled", "--dashboard.port=0",
        ],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["policy_version"] == 3, summary
    assert summary["samples_trained"] == 3 * 2 * 2  # steps x groups x samples, from the engine's token ids
    assert summary["audit"]["ok"] and summary["audit"]["trained_twice"] == 0 and summary["audit"]["lost"] == 0
    assert summary["eval_after_is_final_policy"]
