"""``benchmarks/gpu_check.py`` (``make gpu-check``) on a machine without CUDA: a clear message, exit 2 and a JSON
that records why nothing was checked; its learner-step, engine, colocated-``up`` and weight-sync parts run for real
on the CPU (``--allow-cpu``: gloo, a small model, few steps), so the script that waits for a GPU is known to work up
to the device; and its two pieces of arithmetic and selection: which gpu test files it runs, and MFU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check as check

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)
PARTS = {"pytest_gpu", "learner_step_bf16", "engine_generation", "colocated_up", "nccl_sync", "sglang_fleet"}


def gpu_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}  # no CUDA, whatever the host
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )


def test_without_cuda_it_says_so_exits_2_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = gpu_check(out)
    assert proc.returncode == 2, proc.stderr
    assert "gpu-check: no CUDA device" in proc.stderr and "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    assert (doc["benchmark"], doc["status"], doc["reason"]) == ("gpu_check", "no_cuda", "no CUDA device")
    assert set(doc["parts"]) == PARTS == set(check.PARTS)
    assert all(p == {"status": "skipped", "reason": "no CUDA device"} for p in doc["parts"].values())


# The colocated part runs a whole `up` (about 45 s here): tests/test_colocated_up.py covers that run end to end on
# every suite run, so the check's own colocated part runs in the slow variant only.
@pytest.mark.parametrize(
    "colocated", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fast", "all"]
)
def test_on_the_cpu_the_learner_engine_colocated_and_sync_parts_run_for_real(
    tmp_path: Path, warm_model: Path, colocated: bool
) -> None:
    out = tmp_path / "gpu_check.json"
    skip = [] if colocated else ["--skip", "colocated_up"]
    proc = gpu_check(
        out, "--allow-cpu", "--repeats", "2", "--colocated-steps", "2", "--engine-requests", "32", *skip
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    parts = doc["parts"]
    assert list(parts) == list(check.PARTS)
    assert doc["status"] == "passed" and doc["model_shape"] == "small (--allow-cpu)", doc["failed"]
    step = parts["learner_step_bf16"]
    assert step["status"] == "passed" and step["compute_dtype"] == "torch.bfloat16"
    assert step["grad_norm"] > 0 and step["tokens"] > 0 and step["attention"].startswith("streamrl_packed")
    assert 0 < step["forward_tokens"] < step["tokens"]  # each group's prompt runs once
    assert step["step_seconds"] > 0 and step["tokens_per_s"] > 0 and step["model_flops"] > 0
    assert step["mfu"] is None and "no bf16 peak known for 'cpu'" in step["mfu_reason"]
    engine = parts["engine_generation"]
    assert engine["status"] == "passed" and engine["device"] == "cpu"
    assert engine["requests"] == engine["answered"] == 32 <= 64
    assert engine["generated_tokens"] == 32 * 32 and engine["tokens_per_s"] > 0
    up = parts["colocated_up"]
    if not colocated:
        assert up["status"] == "skipped", up
    else:
        _assert_colocated_part(up)
    sync = parts["nccl_sync"]
    assert sync["status"] == "passed" and sync["backend"] == "gloo" and sync["weights_bit_identical"]
    assert sync["sync_gb_per_s"] > 0 and sync["ratio_vs_flat_broadcast"] > 0
    assert len(sync["samples"]["sync"]) == 2
    for name in ("pytest_gpu", "sglang_fleet"):
        assert parts[name]["status"] == "skipped" and "CUDA" in parts[name]["reason"]


def _assert_colocated_part(up: dict) -> None:
    assert up["status"] == "passed", up
    assert up["steps"] == up["steps_asked"] == 2 and up["updates"] >= up["steps_applied"] >= 1
    assert up["sync_engines_failed"] == 0 and up["seconds_per_update"] > 0
    assert up["audit"]["ok"] and up["audit"]["lost"] == 0 and up["audit"]["trained_twice"] == 0
    assert up["audit"]["trained"] > 0
    assert (up["transport"], up["release_memory"]) == ("tensor", ["kv_cache"])
    assert up["device_plan"]["placement"] == "colocated" and up["device_plan"]["device"] == "cpu"
    assert up["heldout_gain"] == pytest.approx(up["heldout_greedy_after"] - up["heldout_greedy_before"])
    assert up["eval_after_is_final_policy"] is True


def test_the_gpu_test_files_are_those_with_a_gpu_mark_and_no_missing_package(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    files = {
        "test_needs_sglang.py": "import pytest\nimport sglang\n\n@pytest.mark.gpu\ndef test_a():\n    pass\n",
        "test_launches_sglang.py": "import pytest\npytestmark = [pytest.mark.gpu]\n\n"
        "def test_a():\n    EngineConfig(kind='sglang')\n",
        "test_skips_without_flash.py": "import pytest\n\n@pytest.mark.gpu\ndef test_a():\n"
        "    pytest.importorskip('flash_attn')\n",
        "test_plain_gpu.py": "import pytest\nimport torch\npytestmark = pytest.mark.gpu\n\n"
        "def test_a():\n    pass\n",
        "test_cpu.py": "import sglang\n\ndef test_a():\n    pass\n",
        "test_mark_in_a_string.py": "TEXT = 'pytestmark = pytest.mark.gpu'\n\ndef test_a():\n    pass\n",
        "helper.py": "import pytest\npytestmark = pytest.mark.gpu\n",
    }
    for name, text in files.items():
        (tests / name).write_text(text)
    selected, left_out = check.select_gpu_test_files(tests, can_import=lambda module: False)
    assert selected == ["tests/test_plain_gpu.py"]
    assert left_out == {
        "tests/test_launches_sglang.py": "its gpu tests need sglang, which this Python cannot import",
        "tests/test_needs_sglang.py": "its gpu tests need sglang, which this Python cannot import",
        "tests/test_skips_without_flash.py": "its gpu tests need flash_attn, which this Python cannot import",
    }
    everything, none = check.select_gpu_test_files(tests, can_import=lambda module: True)
    assert none == {} and len(everything) == 4  # where sglang and flash_attn import, their files run
    # the real tree: the SGLang files are left out here (no sglang in this venv), the engine's gpu tests run
    real, real_left_out = check.select_gpu_test_files(can_import=lambda module: module != "sglang")
    assert {"tests/test_engine_server.py", "tests/test_colocated_transport.py"} <= set(real)
    assert {"tests/test_fleet_sglang.py", "tests/test_lora_sglang.py"} == set(real_left_out)
    assert "tests/test_gpu_bundle.py" not in real  # its gpu mark is text in a string


def test_mfu_is_model_flops_over_seconds_over_the_bf16_peak() -> None:
    # 6 x 1000 parameters x 5 forward tokens = 30,000; attention 6 x 2 layers x width 4 x (2^2 + 3^2) = 624
    assert check.model_flops(1000, 5, [2, 3], 2, 4) == 30_624.0
    # Qwen2.5-0.5B, one 1,000-token sequence: 6 x 494,032,768 x 1,000 + 6 x 24 x 896 x 1,000,000
    assert check.model_flops(494_032_768, 1000, [1000], 24, 14 * 64) == 2_964_196_608_000 + 129_024_000_000
    value, peak, reason = check.mfu(494.5e12, 1.0, "NVIDIA H200")
    assert (value, peak, reason) == (0.5, 989e12, "")
    assert check.mfu(989e12 / 4, 0.5, "NVIDIA H100 80GB HBM3")[0] == 0.5  # the H100 SXM's name
    assert check.mfu(156e12, 2.0, "NVIDIA A100-SXM4-80GB")[0] == 0.25
    assert check.mfu(36.2e12, 1.0, "NVIDIA L40S")[0] == pytest.approx(0.1)
    for name in ("NVIDIA H100 PCIe", "NVIDIA GeForce RTX 4090", "cpu"):
        value, peak, reason = check.mfu(1e12, 1.0, name)
        assert value is None and peak is None and f"no bf16 peak known for {name!r}" in reason


def test_the_random_model_has_its_rotary_frequencies_not_uninitialised_memory() -> None:
    # a model built on "meta" then moved with to_empty kept garbage in inv_freq: the bf16 step's loss was NaN in
    # some runs (two of three on 2026-12-04)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = check.random_model(check.SMALL, torch.device("cpu"))
    reference = Qwen2ForCausalLM(Qwen2Config(**check.SMALL))
    buffers = dict(model.named_buffers())
    assert "model.rotary_emb.inv_freq" in buffers
    for name, expected in reference.named_buffers():
        torch.testing.assert_close(buffers[name], expected, msg=name)
