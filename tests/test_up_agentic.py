"""`streamrl up --rollout.task.name=tool_arithmetic` end to end: every role as its own process on the multi-turn
calculator task (engines, worker episodes with the calculator and the sandboxed python tool configured, learner,
evaluator, archive), summary.json and the printed summary with the episode counters, every group accounted for,
the archive's rows carrying their turns; and `up` without a model serves the tool warm start for this task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollout_fleet.tool_warmstart import ToolWarmStartRecipe
from streamrl.warm_start import init_tool_warm_model

pytestmark = pytest.mark.timeout(600)
STEPS = 4


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tool warm start of a few steps (seconds): the format is half learned, which is all this test needs,
    some episodes calling the calculator and some answering directly."""
    recipe = ToolWarmStartRecipe(
        max_steps=40, batch_size=32, val_size=8, min_steps=40, eval_every=40, tool_share=0.5
    )
    return init_tool_warm_model(tmp_path_factory.mktemp("tool") / "model", recipe, progress=None)


def test_up_runs_the_multi_turn_task_like_any_other(tmp_path: Path, tool_model: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={tool_model}",
        "--rollout.task.name=tool_arithmetic", f"--learner.max_steps={STEPS}", "--learner.wandb_mode=disabled",
        "--dashboard.port=0", "--dashboard.metrics_base_port=0", "--eval.samples_per_prompt=2",
        "--eval.heldout_prompts=40", "--up.status_interval_s=5",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == STEPS and s["eval_after_is_final_policy"], s
    assert s["audit"]["ok"] and s["audit"]["lost"] == 0 and s["audit"]["trained_twice"] == 0, s["audit"]
    assert set(s["eval_buckets_after"]) == {"direct", "needs_tool"}, s
    e = s["episodes"]
    assert e["episodes"] >= STEPS * 8 and 1.0 <= e["turns_per_episode"] <= 8.0, e
    assert e["tool_calls"] > 0 and e["observation_tokens"] > 0, e  # the half-trained model calls the tool
    assert sum(e["ends"].values()) == e["episodes"], e
    assert f"episodes: {e['episodes']}, {e['turns_per_episode']:.2f} turns each" in out, out[-3000:]
    # the archive has every generated group's samples with their turns (a tool call: two turns or more)
    archive = run_dir / "archive"
    rows = [r for f in sorted(archive.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    samples = [r for r in rows if r.get("sample_index") is not None]
    assert len({r["group_id"] for r in samples}) == s["audit"]["generated"], (len(samples), s["audit"])
    multi = [r for r in samples if r["num_turns"] >= 2]
    assert multi, "no archived sample has two turns"
    for r in multi[:20]:
        bounds = r["turn_bounds"]
        assert len(bounds) == 2 * r["num_turns"] and bounds[-1] == r["num_tokens"]
        between = range(bounds[1], bounds[2])  # the first observation: masked, never trained
        assert all(r["loss_mask"][i] == 0 for i in between) and "<|im_start|>tool" in r["completion_text"]


def test_up_without_a_model_serves_the_tool_warm_start_for_the_tool_task() -> None:
    from rollout_fleet import tool_warmstart
    from rollout_fleet.model import TinyModelSpec
    from streamrl import warm_start

    expected = tool_warmstart.default_path(TinyModelSpec(), ToolWarmStartRecipe())
    calls: list[str] = []
    original = warm_start.init_tool_warm_model
    try:  # the dispatch only: building the full warm start takes minutes (benchmarks/agentic.py does)
        warm_start.init_tool_warm_model = lambda: calls.append("tool") or expected  # type: ignore[assignment]
        assert warm_start.warm_model_for_task("tool_arithmetic") == expected and calls == ["tool"]
    finally:
        warm_start.init_tool_warm_model = original


def test_the_status_line_shows_episodes_only_for_a_multi_turn_run() -> None:
    from streamrl.status import format_status

    rollout = {"tokens_per_s": 10.0, "episodes": 10.0, "turns": 18.0, "tool_calls": 8.0, "tool_errors": 2.0}
    assert format_status({"rollout": rollout}).endswith(" | 1.80 turns/episode, 0.80 tool calls (25% failed)")
    assert "turns/episode" not in format_status({"rollout": {"tokens_per_s": 10.0}})
