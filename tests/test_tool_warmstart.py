"""The tool warm start (rollout_fleet.tool_warmstart): reference episodes with their loss masks, the masked
loss by hand, stop tokens in in-process generation, batched in-process episodes equal to one-at-a-time ones, the
episode metrics by hand, and a short build that writes an atomic, cached model directory."""

from __future__ import annotations

import json

import pytest
import torch

from common.supervised import Example
from learner.sft import masked_step_loss
from rollout_fleet.envs.episode import Episode
from rollout_fleet.envs.tools import tool_observation
from rollout_fleet.local_eval import generate_ids
from rollout_fleet.model import TinyModelSpec, build_model, build_tokenizer
from rollout_fleet.tasks.tool_arithmetic import ToolArithmeticTask
from rollout_fleet.tool_warmstart import (
    ToolWarmStartRecipe,
    episode_example,
    episode_metrics,
    run_episodes,
    training_examples,
)
from rollout_fleet.warmstart import MARKER
from streamrl.warm_start import init_tool_warm_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def task(tokenizer) -> ToolArithmeticTask:
    return ToolArithmeticTask(tokenizer=tokenizer)


def needs_tool_prompt(task: ToolArithmeticTask, needs: bool = True):
    return next(p for p in map(task.make_prompt, range(100)) if p.metadata["needs_tool"] == needs)


def test_a_tool_episode_example_masks_the_prompt_and_the_observation(task, tokenizer) -> None:
    prompt = needs_tool_prompt(task)
    a, b = prompt.metadata["a"], prompt.metadata["b"]
    example = episode_example(task, tokenizer, prompt, use_tool=True)
    ids, mask = example.ids, example.mask
    call, answer = f"<calc>{a}*{b}</calc><|im_end|>", f"#{a * b}<|im_end|>"
    observation = tool_observation(tokenizer, str(a * b))
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt.text + call + observation + answer
    segments = [(prompt.text, 0), (call, 1), (observation, 0), (answer, 1)]
    expected = [m for text, m in segments for _ in tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert mask == expected


def test_a_direct_example_is_one_trained_turn(task, tokenizer) -> None:
    prompt = needs_tool_prompt(task, needs=False)
    example = episode_example(task, tokenizer, prompt, use_tool=False)
    ids, mask = example.ids, example.mask
    n_prompt = len(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
    assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    assert tokenizer.decode(ids[n_prompt:], skip_special_tokens=False) == f"#{prompt.answer}<|im_end|>"


def test_tool_share_sets_how_many_needs_tool_references_call_the_tool(task, tokenizer) -> None:
    def calls(share: float) -> tuple[int, int]:
        recipe = ToolWarmStartRecipe(batch_size=400, tool_share=share)
        texts = [tokenizer.decode(e.ids) for e in training_examples(task, tokenizer, recipe, 0)]
        return sum("<calc>" in t for t in texts), len(texts)

    assert calls(0.0)[0] == 0
    n_tool, n = calls(1.0)
    assert 0.3 * n < n_tool < 0.5 * n  # every needs-tool problem (40 % of the shapes), no direct one
    share = calls(0.3)[0] / n_tool
    assert 0.2 < share < 0.4, share  # 0.3 of them; binomial sd on ~160 is 0.036


def test_the_masked_loss_is_cross_entropy_over_mask_one_tokens_only(tokenizer) -> None:
    model = build_model(TinyModelSpec(), tokenizer)
    examples = [Example([5, 6, 7, 8, 9], [0, 0, 1, 0, 1]), Example([10, 11, 12], [0, 1, 1])]
    loss = masked_step_loss(model, examples, tokenizer.pad_token_id, micro_batches=2)
    by_hand = []
    with torch.no_grad():
        for ids, mask in ((e.ids, e.mask) for e in examples):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)  # (L, V)
            by_hand += [-logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]]
    assert float(loss) == pytest.approx(float(torch.stack(by_hand).mean()), rel=1e-5)


def test_generate_ids_keeps_a_stop_token_and_drops_eos(tokenizer) -> None:
    model = build_model(TinyModelSpec(), tokenizer).eval()
    prompts = [[5, 6, 7], [8, 9]]
    free = generate_ids(model, tokenizer, prompts, max_new_tokens=6)
    stop = free[0][2]  # a token the greedy continuation of the first prompt emits third
    stopped = generate_ids(model, tokenizer, prompts, max_new_tokens=6, stop_token_ids=(stop,))
    assert stopped[0] == free[0][: free[0].index(stop) + 1]
    eos = tokenizer.eos_token_id
    assert all(eos not in out for out in stopped)


def test_batched_episodes_equal_episodes_run_one_at_a_time(task, tokenizer) -> None:
    torch.manual_seed(0)
    model = build_model(TinyModelSpec(), tokenizer).eval()
    prompts = [task.make_prompt(i) for i in range(4)]
    together = run_episodes(model, tokenizer, task, prompts)
    alone = [run_episodes(model, tokenizer, task, [p])[0] for p in prompts]
    assert [e.tokens for e in together] == [e.tokens for e in alone]
    for episode in together:
        assert len(episode.tokens) == len(episode.loss_mask) and episode.turns


def test_episode_metrics_by_hand(task, tokenizer) -> None:
    tool_p, direct_p = needs_tool_prompt(task), needs_tool_prompt(task, needs=False)

    def episode(text_turns: list[str], observation: str = "", tool_calls: int = 0) -> Episode:
        e = Episode(tool_calls=tool_calls)
        for k, turn in enumerate(text_turns):
            if k:
                obs = tokenizer(observation, add_special_tokens=False)["input_ids"]
                e.tokens += obs
                e.loss_mask += [0] * len(obs)
            ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
            e.tokens += ids
            e.loss_mask += [1] * len(ids)
            e.turns.append(None)  # type: ignore[arg-type]
        return e

    obs = tool_observation(tokenizer, tool_p.answer)
    a, b = tool_p.metadata["a"], tool_p.metadata["b"]
    episodes = [
        episode([f"<calc>{a}*{b}</calc><|im_end|>", f"#{tool_p.answer}<|im_end|>"], obs, tool_calls=1),
        episode(["#1<|im_end|>"]),  # a wrong direct answer to the same problem
        episode([f"#{direct_p.answer}<|im_end|>"]),
    ]
    m = episode_metrics(task, tokenizer, [tool_p, tool_p, direct_p], episodes)
    assert m["n"] == 3 and m["n_needs_tool"] == 2 and m["n_direct"] == 1
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["accuracy_needs_tool"] == 0.5 and m["tool_call_rate_needs_tool"] == 0.5
    assert m["tool_accuracy"] == 1.0 and m["tool_call_rate_direct"] == 0.0
    assert m["turns_per_episode"] == pytest.approx(4 / 3)
    n_obs = len(tokenizer(obs, add_special_tokens=False)["input_ids"])
    assert m["masked_token_share"] == pytest.approx(n_obs / sum(len(e.tokens) for e in episodes))


def test_a_short_build_writes_a_cached_model_with_its_record(tmp_path, tokenizer) -> None:
    recipe = ToolWarmStartRecipe(max_steps=3, batch_size=8, val_size=8, min_steps=3, eval_every=3)
    lines: list[str] = []
    path = init_tool_warm_model(tmp_path / "m", recipe, progress=lines.append)
    record = json.loads((path / MARKER).read_text())
    assert record["steps"] == 3 and len(record["losses"]) == 3 and record["validation"][0]["step"] == 3
    assert record["eval_after"]["greedy"]["n"] == ToolArithmeticTask().heldout_size
    assert any("stopped at step 3" in line for line in lines)
    assert not (tmp_path / "m.staging").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert init_tool_warm_model(tmp_path / "m", recipe, progress=lines.append) == path  # cached: not rebuilt
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_bad_recipe_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="tool_share must be in"):
        ToolWarmStartRecipe(tool_share=1.5).check()
    with pytest.raises(ValueError, match="max_steps must be an int >= 1, got 0"):
        ToolWarmStartRecipe(max_steps=0).check()
