"""Supervised warm-start and held-out evaluation of the tiny model (real training on CPU, one thread)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from learner.sft import masked_step_loss, padded_batch
from rollout_fleet.local_eval import evaluate, generate, load_model
from rollout_fleet.model import TinyModelSpec, build_model, build_tokenizer
from rollout_fleet.tasks.arithmetic import ArithmeticTask
from rollout_fleet.warmstart import MARKER, PINNED_NUMERICS, fingerprint, make_examples, make_recipe
from streamrl.warm_start import init_warm_model, main

SMALL_STEPS = 50


@pytest.fixture(scope="session")
def small_warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """A short warm-start (the full one is the slow test below): enough to learn the scratchpad format."""
    torch.set_num_threads(1)
    lines: list[str] = []
    path = init_warm_model(
        tmp_path_factory.mktemp("cache") / "warm", steps=SMALL_STEPS, progress=lines.append
    )
    yield path, lines


def test_batches_put_loss_on_output_tokens_only() -> None:
    tokenizer, task = build_tokenizer(), ArithmeticTask()
    examples = make_examples(task, tokenizer, [0, 1])
    prompt = task.make_prompt(1)
    ids, n_prompt = examples[1].ids, examples[1].mask.index(1)
    assert examples[1].mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    assert tokenizer.decode(ids[:n_prompt]) == prompt.text
    assert tokenizer.decode(ids[n_prompt:]) == task.reference_completion(prompt) + tokenizer.eos_token
    input_ids, labels = padded_batch(examples, tokenizer.pad_token_id)
    for row, example in enumerate(examples):
        ids, n_prompt = example.ids, example.mask.index(1)
        assert labels[row, :n_prompt].eq(-100).all() and labels[row, len(ids) :].eq(-100).all()
        assert (
            labels[row, n_prompt : len(ids)].tolist()
            == ids[n_prompt:]
            == input_ids[row, n_prompt : len(ids)].tolist()
        )
    # the bucketed loss is the mean over output tokens, whatever the micro-batching
    model = build_model(TinyModelSpec(), tokenizer)
    reference = model(input_ids=input_ids, labels=labels).loss
    for micro in (1, 2):
        model.zero_grad()
        assert masked_step_loss(model, examples, tokenizer.pad_token_id, micro).item() == pytest.approx(
            reference.item(), rel=1e-5
        )


def test_generation_matches_hf_generate_greedy() -> None:
    tokenizer = build_tokenizer()
    model = build_model(TinyModelSpec(), tokenizer).eval()
    prompts = ["1+2=", "12345678+87654321=", "45+5="]  # mixed lengths: left padding must not change results
    ours = generate(model, tokenizer, prompts, max_new_tokens=12)
    for text, got in zip(prompts, ours, strict=True):
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        ref = model.generate(**encoded, max_new_tokens=12, do_sample=False)[
            0, encoded.input_ids.shape[1] :
        ].tolist()
        assert got == (ref[: ref.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ref else ref)


def test_short_warm_start_learns_the_format_and_is_saved_with_its_record(
    small_warm: tuple[Path, list[str]],
) -> None:
    path, lines = small_warm
    record = json.loads((path / MARKER).read_text())
    assert record["fingerprint"] == fingerprint(TinyModelSpec(), make_recipe(steps=SMALL_STEPS))
    assert record["steps"] == SMALL_STEPS and len(record["losses"]) == SMALL_STEPS
    losses = record["losses"]
    assert sum(losses[-10:]) < sum(losses[:10]) / 3
    before, after = record["eval_before"], record["eval_after"]
    assert before["n"] == after["n"] == 200
    assert before["format_rate"] == 0.0 and before["greedy_accuracy"] == 0.0  # the random base model
    assert after["format_rate"] >= 0.5 > before["format_rate"]
    assert any(f"warm-start step {SMALL_STEPS}/{SMALL_STEPS}" in line for line in lines)
    # what was saved is what was trained: reloading reproduces the recorded held-out numbers exactly
    model, tokenizer = load_model(path)
    assert evaluate(model, tokenizer) == after
    # batched generation (left padding, finished rows leaving the batch and its cache) equals one at a time
    task = ArithmeticTask()
    prompts = [task.make_prompt(i, "test").text for i in range(24)]
    batched = generate(model, tokenizer, prompts)
    assert sum(len(ids) < 96 for ids in batched) >= 12  # enough rows stop early for the batch to shrink
    assert batched == [generate(model, tokenizer, [text])[0] for text in prompts]


def test_warm_start_is_cached_and_fingerprinted(small_warm: tuple[Path, list[str]]) -> None:
    path, _ = small_warm
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    calls: list[str] = []
    assert init_warm_model(path, steps=SMALL_STEPS, progress=calls.append) == path
    assert calls == [] and (path / "model.safetensors").stat().st_mtime_ns == stamp
    spec, base = TinyModelSpec(), make_recipe(steps=SMALL_STEPS)
    others = [
        make_recipe(steps=SMALL_STEPS + 1),
        make_recipe(steps=SMALL_STEPS, seed=1),
        make_recipe(steps=SMALL_STEPS, lr=1e-3),
        make_recipe(steps=SMALL_STEPS, target=0.3),
    ]
    keys = {fingerprint(spec, r) for r in others} | {fingerprint(TinyModelSpec(seed=1), base)}
    assert fingerprint(spec, base) not in keys and len(keys) == 5


def test_two_builds_are_bit_identical_whatever_the_caller_set(
    small_warm: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build runs in a child under PINNED_NUMERICS: a caller with other threads and ATen's default (AVX-512
    where the CPU has it) kernels builds the same bits. Without the pins these two builds differ here."""
    path, lines = small_warm
    assert any(
        line.startswith("warm-start step") for line in lines
    )  # the child's progress reaches the caller
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    again = init_warm_model(tmp_path / "warm", steps=SMALL_STEPS, progress=None)
    digest = [hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest() for p in (path, again)]
    assert digest[0] == digest[1]
    records = [json.loads((p / MARKER).read_text()) for p in (path, again)]
    assert records[0]["losses"] == records[1]["losses"]
    assert records[1]["numerics"] == PINNED_NUMERICS and records[1]["torch_threads"] == 1
    assert records[1]["cpu_capability"] in ("AVX2", "DEFAULT")  # DEFAULT: a CPU without AVX2 (not x86-64)


def test_command_line(small_warm: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0
    usage = capsys.readouterr().out
    assert all(flag in usage for flag in ("--out", "--steps", "--seed", "--lr", "--target"))
    with pytest.raises(SystemExit) as bad:
        main(["--steps", "0"])
    assert bad.value.code == 2 and "max_steps must be an int >= 1, got 0" in capsys.readouterr().err
    path, _ = small_warm
    assert main(["--out", str(path), "--steps", str(SMALL_STEPS)]) == 0  # cached: returns at once
    printed = json.loads(capsys.readouterr().out)
    assert printed["path"] == str(path) and printed["steps"] == SMALL_STEPS


@pytest.mark.slow
def test_default_warm_start_solves_some_but_not_most_heldout_prompts(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = init_warm_model(tmp_path / "warm", seed=0, progress=None)
    record = json.loads((path / MARKER).read_text())
    assert record["reached_target"] and record["validation"]
    before, after = record["eval_before"], record["eval_after"]
    assert before["greedy_accuracy"] == 0.0
    assert 0.3 <= after["greedy_accuracy"] <= 0.6
    assert 0.15 <= after["sampled_accuracy"] <= 0.45
