"""`streamrl sft`: the JSONL and Parquet data and its loss masks, the masked loss by hand, and real runs of the
command (spawned FSDP2 ranks over gloo): the loss falls, 2 ranks (reading the rows as Parquet) agree with 1, a run
killed after a checkpoint and resumed ends on the weights of an uninterrupted one, bad data is refused naming the
line and the field."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from common.supervised import Example
from learner.sft import TrainRecipe, lr_at, masked_step_loss, step_indices
from learner.sft_data import DataError, chat_example, load_examples
from rollout_fleet.model import TinyModelSpec, build_model, build_tokenizer, init_tiny_model

# a run of the command is a few seconds on a quiet machine; a loaded 2-core one took minutes
pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]
PAIRS = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(1, 13)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, object]], row_group_size: int = 3) -> Path:
    # small row groups: the rows of a dataset span several, and their numbers must run on across them
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_a_prompt_completion_line_trains_on_the_completion_and_eos(tmp_path: Path, tokenizer) -> None:
    (example,) = load_examples(
        write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "completion": "3"}]), tokenizer
    )
    # the tiny tokenizer has one token per character
    assert tokenizer.decode(example.ids) == "1+2=3" + tokenizer.eos_token
    assert example.mask == [0, 0, 0, 0, 1, 1]


def test_chat_messages_train_on_assistant_turns_without_their_header(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "x", "loss": True},
        {"role": "assistant", "content": "no", "loss": False},
    ]
    example = chat_example(tokenizer, messages)
    segments = [  # the template: <|im_start|>ROLE\nCONTENT<|im_end|>\n per turn
        ("<|im_start|>user\nhi<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        ("ok<|im_end|>\n", 1),
        ("<|im_start|>user\nx<|im_end|>\n", 1),  # another role's turn with loss is trained whole
        ("<|im_start|>assistant\nno<|im_end|>\n", 0),
    ]
    ids = [t for text, _ in segments for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    mask = [m for text, m in segments for _ in tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert example.ids == ids and example.mask == mask
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    # the turns' seams are clean: the same tokens as the whole rendering
    assert example.ids == tokenizer(whole, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "line 2: not JSON"),
        ('{"prompt": "1+1="}', "line 2: field 'completion' is missing"),
        ('{"prompt": 3, "completion": "x"}', "line 2: field 'prompt' must be a str, got 3"),
        ('{"messages": [{"role": "user"}]}', "line 2: messages[0]: field 'content' is missing"),
        (
            '{"messages": [{"role": "user", "content": "a"}]}',
            "line 2: field 'messages' has no turn with loss",
        ),
        ('{"messages": [{"role": "assistant", "content": "a", "loss": 1}]}', "field 'loss' must be a bool"),
        ('{"text": "a"}', "line 2: needs field 'messages', or fields 'prompt' and 'completion'"),
        ("[1, 2]", "line 2: a line must be a JSON object"),
    ],
)
def test_bad_lines_are_refused_naming_the_line_and_the_field(
    tmp_path: Path, tokenizer, line: str, expected: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        load_examples(path, tokenizer)


CHATS = [
    {
        "messages": [
            {"role": "system", "content": f"add {a}"},
            {"role": "user", "content": f"{a}+{a}="},
            {"role": "assistant", "content": "let me see", "loss": False},
            {"role": "user", "content": "well?", "loss": True},
            {"role": "assistant", "content": str(2 * a)},
        ]
    }
    for a in range(1, 8)
]


@pytest.mark.parametrize("rows", [PAIRS, CHATS], ids=["prompt_completion", "chat_with_masked_turns"])
def test_parquet_rows_give_the_examples_of_the_same_jsonl_lines(tmp_path: Path, tokenizer, rows) -> None:
    parquet = load_examples(write_parquet(tmp_path / "d.parquet", rows), tokenizer)
    jsonl = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer)
    assert len(parquet) == len(rows) and parquet == jsonl  # the same token ids and loss masks, in order
    assert any(0 < e.targets < len(e.mask) for e in parquet)  # the masks are not trivial


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"prompt": "1+1=", "completion": None}, "row 5: field 'completion' is missing"),
        ({"prompt": "1+1=", "completion": ""}, "row 5: field 'completion' is empty"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
            "row 5: messages[1]: field 'content' is missing",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "loss": False}]},
            "row 5: field 'messages' has no turn with loss",
        ),
        ({"messages": []}, "row 5: field 'messages' is empty"),
    ],
    ids=["no_completion", "empty_completion", "message_without_content", "no_turn_with_loss", "no_messages"],
)
def test_a_bad_parquet_row_is_refused_naming_the_row_and_the_field(
    tmp_path: Path, tokenizer, bad: dict[str, object], expected: str
) -> None:
    # row 5 is in the second row group (3 rows each): its number is counted over the file, from 1
    key = "messages" if "messages" in bad else "prompt"
    good = CHATS[0] if key == "messages" else PAIRS[0]
    path = write_parquet(tmp_path / "bad.parquet", [good] * 4 + [bad] + [good])
    with pytest.raises(DataError, match=re.escape(f"{path} {expected}")):
        load_examples(path, tokenizer)


def test_a_parquet_row_of_the_wrong_type_or_length_is_refused(tmp_path: Path, tokenizer) -> None:
    path = write_parquet(tmp_path / "ints.parquet", [{"prompt": 3, "completion": "x"}])
    with pytest.raises(DataError, match=re.escape(f"{path} row 1: field 'prompt' must be a str, got 3")):
        load_examples(path, tokenizer)
    path = write_parquet(tmp_path / "long.parquet", PAIRS)
    with pytest.raises(DataError, match=re.escape(f"{path} row 1: 6 tokens, more than sft.max_seq_len = 5")):
        load_examples(path, tokenizer, max_seq_len=5)


def test_a_parquet_file_without_the_columns_is_refused_naming_its_columns(tmp_path: Path, tokenizer) -> None:
    for rows in ([{"text": "a", "id": 1}], [{"prompt": "a", "id": 1}]):
        path = write_parquet(tmp_path / "other.parquet", rows)
        names = sorted(rows[0])
        expected = f"{path}: needs column 'messages', or columns 'prompt' and 'completion' (it has {names})"
        with pytest.raises(DataError, match=re.escape(expected)):
            load_examples(path, tokenizer)
    (tmp_path / "junk.parquet").write_text(json.dumps(PAIRS[0]) + "\n")
    with pytest.raises(DataError, match="junk.parquet: not a Parquet file"):
        load_examples(tmp_path / "junk.parquet", tokenizer)


def test_a_data_file_of_another_suffix_is_refused(tmp_path: Path, tokenizer, capsys) -> None:
    from streamrl.cli import main

    # the file would read fine as JSON lines: the suffix alone refuses it
    path = write_jsonl(tmp_path / "train.csv", PAIRS)
    expected = f"sft.data = {str(path)!r}: unknown format '.csv'"
    with pytest.raises(DataError, match=re.escape(expected)):
        load_examples(path, tokenizer)
    # and the command refuses it before any rank starts
    assert main(["sft", f"--shared.run_dir={tmp_path / 'run'}", f"--sft.data={path}"]) == 2
    assert expected in capsys.readouterr().err


def test_the_masked_loss_by_hand_and_no_gradient_at_unmasked_positions(tokenizer) -> None:
    torch.manual_seed(0)
    model = build_model(TinyModelSpec(), tokenizer)
    example = Example([5, 6, 7, 8, 9, 10], [0, 0, 1, 0, 1, 0])
    captured: list[torch.Tensor] = []

    def keep(_module, _inputs, output: torch.Tensor) -> None:
        output.retain_grad()
        captured.append(output)

    model.lm_head.register_forward_hook(keep)
    loss = masked_step_loss(model, [example], tokenizer.pad_token_id, micro_batches=1)
    with torch.no_grad():
        logp = torch.log_softmax(captured[0][0].float(), -1)  # (L, V)
    # targets are tokens 2 and 4, predicted at positions 1 and 3: the mean of their negative log-probabilities
    assert float(loss) == pytest.approx(float(-(logp[1, 7] + logp[3, 9]) / 2), rel=1e-6)
    grad = captured[0].grad[0]  # (L, V): d loss / d logits
    assert [bool(grad[p].abs().sum() > 0) for p in range(6)] == [False, True, False, True, False, False]


def test_lr_schedules_by_hand() -> None:
    cosine = TrainRecipe(max_steps=12, lr=1.0, warmup_steps=2, lr_schedule="cosine", final_lr_ratio=0.5)
    assert [lr_at(s, cosine) for s in (0, 1, 2, 7)] == [0.5, 1.0, 1.0, pytest.approx(0.75)]
    assert lr_at(12, cosine) == pytest.approx(0.5)
    constant = TrainRecipe(max_steps=12, lr=1.0, warmup_steps=4)
    assert [lr_at(s, constant) for s in (0, 3, 4, 11)] == [0.25, 1.0, 1.0, 1.0]


def test_step_indices_walk_every_example_once_per_epoch() -> None:
    first_epoch = [i for step in range(3) for i in step_indices(12, 4, seed=0, step=step)]
    assert sorted(first_epoch) == list(range(12)) and first_epoch != list(range(12))
    assert step_indices(12, 5, 0, 2)[:2] == first_epoch[10:]  # a batch spanning two epochs
    assert step_indices(12, 4, 1, 0) != step_indices(12, 4, 0, 0)


# ---- real runs of the command --------------------------------------------------------------------------------


def run_sft(tmp_path: Path, name: str, data: Path, *extra: str, env: dict[str, str] | None = None):
    model = init_tiny_model(tmp_path / "base")
    run_dir = tmp_path / name
    command = [sys.executable, "-m", "streamrl", "sft", f"--shared.run_dir={run_dir}",
               f"--shared.model_path={model}", f"--sft.data={data}", "--sft.max_steps=6", "--sft.batch_size=4",
               "--sft.lr=3e-3", "--sft.checkpoint_every=3", "--sft.seed=1", *extra]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("RANK", None)
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return done, run_dir


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "latest" / "model.safetensors")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("sft")
    data = write_jsonl(tmp / "pairs.jsonl", PAIRS)
    done, run_dir = run_sft(tmp, "one", data)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, run_dir


def test_sft_lowers_the_loss_and_exports_the_result(one_rank: tuple[Path, Path]) -> None:
    _, run_dir = one_rank
    summary = json.loads((run_dir / "export" / "latest" / "sft.json").read_text())
    assert summary["step"] == 6 and len(summary["losses"]) == 6
    assert summary["losses"][-1] < summary["losses"][0] * 0.8
    assert (run_dir / "export" / "latest" / "config.json").is_file()
    assert (run_dir / "config.sft.toml").is_file()


def test_two_ranks_agree_with_one(one_rank: tuple[Path, Path]) -> None:
    tmp, run_dir = one_rank
    # the same rows as Parquet: the command reads them as it reads the JSONL of the one-rank run
    parquet = write_parquet(tmp / "pairs.parquet", PAIRS)
    done, two = run_sft(tmp, "two", parquet, "--sft.world_size=2")
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = exported(run_dir), exported(two)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)
    losses = [
        json.loads((d / "export" / "latest" / "sft.json").read_text())["losses"] for d in (run_dir, two)
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_weights(one_rank: tuple[Path, Path]) -> None:
    tmp, run_dir = one_rank
    data = tmp / "pairs.jsonl"
    crashed, resumed = run_sft(tmp, "resumed", data, env={"STREAMRL_CRASH_AT": "sft.checkpointed@1"})
    assert crashed.returncode != 0 and "crash point sft.checkpointed" in crashed.stderr
    assert not (resumed / "export").exists()
    done, _ = run_sft(tmp, "resumed", data)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    a, b = exported(run_dir), exported(resumed)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert (
        json.loads((resumed / "export" / "latest" / "sft.json").read_text())["losses"]
        == json.loads((run_dir / "export" / "latest" / "sft.json").read_text())["losses"][3:]
    )


def test_sft_on_chat_messages(one_rank: tuple[Path, Path]) -> None:
    tmp, _ = one_rank
    rows = [
        {
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["completion"]},
            ]
        }
        for p in PAIRS
    ]
    done, run_dir = run_sft(tmp, "chat", write_jsonl(tmp / "chat.jsonl", rows), "--sft.micro_batches=2")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads((run_dir / "export" / "latest" / "sft.json").read_text())["losses"]
    assert losses[-1] < losses[0] * 0.8


def test_bad_data_stops_the_command_with_the_line_and_field(one_rank: tuple[Path, Path]) -> None:
    tmp, _ = one_rank
    bad = write_jsonl(tmp / "bad.jsonl", [PAIRS[0], {"prompt": "1+1="}])
    done, run_dir = run_sft(tmp, "bad", bad)
    assert done.returncode == 2
    assert f"{bad} line 2: field 'completion' is missing" in done.stderr
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_the_command_needs_its_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from streamrl.cli import main

    assert main(["sft", "--help"]) == 0
    out = capsys.readouterr().out
    assert "\n[sft]" in out and "--sft.data " in out and "--sft.lr_schedule " in out
    assert main(["sft", f"--shared.run_dir={tmp_path}"]) == 2
    assert "sft.data is not set" in capsys.readouterr().err
