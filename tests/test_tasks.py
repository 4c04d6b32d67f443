"""Tasks, verifiers and prompt datasets: hand-computed examples, determinism, held-out disjointness, bad input."""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_fleet.datasets import ChatFormatter, DatasetError, PromptDataset, read_rows
from rollout_fleet.model import build_tokenizer
from rollout_fleet.tasks import TaskError, available_tasks, get_task
from rollout_fleet.tasks.arithmetic import DIGIT_COUNTS, ArithmeticTask, Problem, score_completion, scratchpad
from rollout_fleet.tasks.config import build_task, task_config
from rollout_fleet.tasks.countdown import CountdownTask, check_answer, evaluate, extract_expression
from rollout_fleet.tasks.gsm8k import answers_match, extract_answer, gold_from_solution, parse_number


# ---- arithmetic ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (3, 4, "3+4+0=7c0;#7"),
        (0, 0, "0+0+0=0c0;#0"),
        (7, 5, "7+5+0=2c1;#12"),
        (57, 68, "7+8+0=5c1;5+6+1=2c1;#125"),
        (999, 1, "9+1+0=0c1;9+0+1=0c1;9+0+1=0c1;#1000"),  # different lengths: the short number gives 0s
        (1, 999, "1+9+0=0c1;0+9+1=0c1;0+9+1=0c1;#1000"),
        (405, 596, "5+6+0=1c1;0+9+1=0c1;4+5+1=0c1;#1001"),
    ],
)
def test_scratchpad_by_hand(a: int, b: int, expected: str) -> None:
    assert scratchpad(a, b) == expected
    assert score_completion(str(a + b), expected).components == {"correct": 1.0, "format": 1.0}


def test_longest_scratchpad_is_90_characters() -> None:
    longest = scratchpad(99999999, 99999999)
    assert longest == "9+9+0=8c1;" + "9+9+1=9c1;" * 7 + "#199999998"
    assert len(longest) == 90


@pytest.mark.parametrize(
    ("completion", "correct", "fmt"),
    [
        ("7+8+0=5c1;5+6+1=2c1;#125", 1, 1),
        ("7+8+0=5c1;5+6+1=2c1;#125<|endoftext|>", 1, 1),  # engines may keep the stop token's text
        ("7+8+0=5c1;5+6+1=2c1;#125\n", 1, 1),
        ("7+8+0=5c1;5+6+1=2c1;#126", 0, 1),  # wrong answer, good format
        ("7+8+0=5c1;5+6+0=1c1;#125", 1, 1),  # a wrong step is still well-formed; only the answer counts
        ("#125", 1, 0),  # right answer without the scratchpad
        ("7+8+0=5 c1;5+6+1=2 c1;#125", 1, 0),  # a space is not the format
        ("7+8+0=5c1;5+6+1=2c1#125", 1, 0),  # missing ';'
        ("7+8+0=5c1;5+6+1=2c1;#125;3+4", 0, 0),  # did not stop after the answer
        ("7+8+0=5c1;5+6+1=2c1;125", 0, 0),  # no '#'
        ("7+8+0=5c1;#12 5", 0, 0),
        ("", 0, 0),
        ("#", 0, 0),
        ("#١٢٥", 0, 0),  # non-ASCII digits are not an answer
    ],
)
def test_arithmetic_verifier(completion: str, correct: int, fmt: int) -> None:
    result = score_completion("125", completion)
    assert result.components == {"correct": float(correct), "format": float(fmt)}
    assert result.reward == float(correct) and result.status == "ok"


def test_an_answer_of_thousands_of_digits_is_wrong_not_an_error() -> None:
    """int() refuses strings of more than 4,300 digits; a long output can end in that many."""
    result = score_completion("125", "7+8+0=5c1;5+6+1=2c1;#" + "1" * 5000)
    assert result.status == "ok" and result.components == {"correct": 0.0, "format": 1.0}
    assert score_completion("125", "#000125").components["correct"] == 1.0  # leading zeros: the same number


def test_format_weight_adds_a_small_format_term() -> None:
    task = get_task("arithmetic", format_weight=0.1)
    prompt = task.make_prompt(0)
    good = task.reference_completion(prompt)
    assert task.score(prompt, good).reward == pytest.approx(1.1)
    assert task.score(prompt, good.split("#")[0] + "#0" * 3).reward == pytest.approx(0.0)
    assert task.score(prompt, "x").reward == 0.0
    with pytest.raises(TaskError, match="format_weight"):
        get_task("arithmetic", format_weight=-1)


def test_prompts_are_deterministic_and_shaped() -> None:
    task, again, other = ArithmeticTask(seed=0), ArithmeticTask(seed=0), ArithmeticTask(seed=1)
    prompts = [task.make_prompt(i) for i in range(50)]
    assert prompts == [again.make_prompt(i) for i in range(50)]
    assert [p.text for p in prompts] != [other.make_prompt(i).text for i in range(50)]
    assert len({p.prompt_id for p in prompts}) == 50
    for p in prompts:
        a, b = p.metadata["a"], p.metadata["b"]
        assert p.text == f"{a}+{b}=" and p.answer == str(a + b)
        assert len(str(a)) == len(str(b)) == p.metadata["digits"] in DIGIT_COUNTS
        assert task.score(p, task.reference_completion(p)).reward == 1.0


def test_digit_mix_and_output_lengths_follow_the_recipe() -> None:
    task = ArithmeticTask()
    prompts = [task.make_prompt(i) for i in range(6000)]
    share = Counter(p.metadata["digits"] for p in prompts)
    for digits, weight in zip(DIGIT_COUNTS, (30, 30, 20, 10, 6, 4), strict=True):
        assert abs(share[digits] / len(prompts) - weight / 100) < 0.025, (digits, share)
    lengths = sorted(len(task.reference_completion(p)) for p in prompts)
    assert 28 <= statistics.mean(lengths) <= 32
    assert lengths[len(lengths) // 2] in (23, 24)
    assert 66 <= lengths[int(0.95 * len(lengths))] <= 70 and lengths[-1] <= 90


def test_heldout_set_is_disjoint_from_train_prompts() -> None:
    task = ArithmeticTask()
    assert task.num_prompts("test") == 200
    heldout = [task.problem(i, "test") for i in range(200)]
    keys = {p.key for p in heldout}
    assert len(keys) > 150 and all(task.is_heldout(p) for p in heldout)
    digits = Counter(len(str(p.a)) for p in heldout)
    assert set(digits) == set(DIGIT_COUNTS)
    # no train prompt equals a held-out problem in either order (well past one epoch of indices)
    train = {task.problem(i).key for i in itertools.chain(range(20000), range(10_000_000, 10_005_000))}
    assert train.isdisjoint(keys)
    # the warm-start's validation stream: held-out space (never a train problem), not the test prompts
    validation = [task.validation_prompt(i) for i in range(300)]
    validation_keys = {Problem(p.metadata["a"], p.metadata["b"]).key for p in validation}
    assert all(task.is_heldout(Problem(*key)) for key in validation_keys) and train.isdisjoint(
        validation_keys
    )
    assert [p.text for p in validation[:200]] != [p.text for p in task.prompts("test")]
    with pytest.raises(TaskError, match="out of range"):
        task.make_prompt(200, "test")
    with pytest.raises(TaskError, match="unknown split"):
        task.make_prompt(0, "validation")


# ---- registry and config ------------------------------------------------------------------------------------
def test_registry_builds_tasks_by_name_and_rejects_bad_options() -> None:
    assert {"arithmetic", "gsm8k", "countdown", "dataset"} <= set(available_tasks())
    assert get_task("arithmetic", seed=3).seed == 3
    with pytest.raises(TaskError, match="unknown task 'nope'"):
        get_task("nope")
    with pytest.raises(TaskError, match=r"does not take option\(s\) \['dataset'\]"):
        get_task("arithmetic", dataset="x.jsonl")
    with pytest.raises(
        TaskError, match=r"(?s)task arithmetic: .*seed = -1: Input should be greater than or equal to 0"
    ):
        get_task("arithmetic", seed=-1)
    custom = get_task("rollout_fleet.tasks.arithmetic:ArithmeticTask", heldout_size=5)
    assert custom.num_prompts("test") == 5
    with pytest.raises(TaskError, match="cannot import module"):
        get_task("no_such_module:Task")


def test_task_config_builds_the_task_and_names_bad_options(tmp_path: Path) -> None:
    task = build_task(task_config(name="arithmetic", seed=2, heldout_size=10), tokenizer=build_tokenizer())
    assert (task.seed, task.num_prompts("test")) == (2, 10)
    with pytest.raises(TaskError, match="prompt_field: not a field of task countdown"):
        task_config(name="countdown", prompt_field="q")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "hi", "answer": "#### 3"}) + "\n")
    gsm = build_task(task_config(name="gsm8k", dataset=str(path), chat_template="always"), build_tokenizer())
    assert gsm.make_prompt(0).text.startswith("<|im_start|>user\nhi\n")


# ---- gsm8k --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "answer", "how"),
    [
        ("so the total is \\boxed{1,234}.", "1,234", "boxed"),
        ("\\boxed{7} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "boxed"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", "hash"),
        ("#### 5\n#### 1,200 dollars\nmore", "1,200 dollars", "hash"),
        ("She pays $18.00 in total.", "18.00", "last_number"),
        ("I gave -3 then 12,500 apples.", "12,500", "last_number"),
        ("no idea", None, "none"),
        ("\\boxed{unclosed 42", "42", "last_number"),
    ],
)
def test_gsm8k_extraction(text: str, answer: str | None, how: str) -> None:
    assert extract_answer(text) == (answer, how)


@pytest.mark.parametrize(
    ("predicted", "gold", "match"),
    [
        ("1,234", "1234", True),
        ("72.0", "72", True),
        ("72.", "72", True),
        ("$18", "18", True),
        ("18 dollars", "18", True),
        ("50%", "50", True),
        ("\\frac{1}{2}", "0.5", True),
        ("0.3333333", "1/3", True),  # non-integer gold: relative 1e-6
        ("1000001", "1000000", False),  # integer gold: exact
        ("-4", "4", False),
        ("abc", "72", False),
        (None, "72", False),
        ("1e9", "1000000000", False),  # no scientific notation
    ],
)
def test_gsm8k_numeric_comparison(predicted: str | None, gold: str, match: bool) -> None:
    assert answers_match(predicted, gold) is match


def test_gsm8k_task_from_jsonl_scores_components(tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "2+2?", "answer": "two and two\n#### 4"},
        {"question": "Big?", "answer": "#### 1,200"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = get_task("gsm8k", dataset=str(path))
    first, second = task.make_prompt(0), task.make_prompt(1)
    assert first.text == '2+2?\nThink step by step, then give the final answer after "####".'
    assert (first.answer, second.answer) == ("4", "1200")
    assert task.score(first, "2 and 2 make 4\n#### 4").components == {"correct": 1.0, "format": 1.0}
    assert task.score(second, "It is 1,200.").components == {"correct": 1.0, "format": 0.0}
    assert task.score(second, "\\boxed{1200.0}").components == {"correct": 1.0, "format": 1.0}
    assert task.score(first, "#### 5").components == {"correct": 0.0, "format": 1.0}
    assert gold_from_solution("so \\boxed{3/4}") == "3/4" and parse_number("3/4") == Fraction(3, 4)
    assert task.num_prompts("test") == 0


# ---- countdown ----------------------------------------------------------------------------------------------
def test_countdown_safe_evaluation() -> None:
    assert evaluate("(1 + 2) * 3") == (Fraction(9), [1, 2, 3])
    assert evaluate("6/(1-3/4)") == (Fraction(24), [6, 1, 3, 4])  # exact fractions
    for bad, reason in [
        ("5 / (3 - 3)", "division by zero"),
        ("2 ** 3", "unexpected '*'"),
        ("__import__('os')", "unexpected character '_'"),
        ("(1 + 2", "missing ')'"),
        ("1 +", "expression ends early"),
        ("1 2", "after a complete expression"),
        ("-3 + 5", "unexpected '-'"),
        ("", "empty expression"),
        ("(" * 100 + "1" + ")" * 100, "nested deeper"),
    ]:
        with pytest.raises(
            ValueError, match=reason.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
        ):
            evaluate(bad)


@pytest.mark.parametrize(
    ("expression", "ok", "reason"),
    [
        ("(7 - 3) * 5", True, "ok"),
        ("7 * 3 - 5 + 4", False, "beyond the numbers"),  # 4 is not offered
        ("3 * 3 + 5", False, "beyond the numbers"),  # 3 used twice
        ("5 / (7 - 7)", False, "division by zero"),
        ("7 + 5", False, "evaluates to 12, not 20"),
        ("(7 - 3) * 5 + 0", False, "beyond the numbers"),
    ],
)
def test_countdown_answers(expression: str, ok: bool, reason: str) -> None:
    correct, why = check_answer(expression, [3, 5, 7], 20)
    assert correct is ok and reason in why


def test_countdown_scoring_and_use_all() -> None:
    task = get_task("countdown")
    prompt = task.make_prompt(0)
    nums, target = prompt.metadata["nums"], prompt.metadata["target"]
    assert str(nums) in prompt.text and str(target) in prompt.text
    solution = _solve(nums, target)
    assert solution is not None, "generated targets are reachable by construction"
    assert task.score(prompt, f"thinking...<answer> {solution} </answer>").components == {
        "correct": 1.0,
        "format": 1.0,
    }
    assert task.score(prompt, f"<answer>{solution} = {target}</answer>").reward == 1.0
    assert task.score(prompt, f"no tags\n{solution}").components == {"correct": 1.0, "format": 0.0}
    assert task.score(prompt, "<answer>1/0</answer>").components == {"correct": 0.0, "format": 0.0}
    assert extract_expression("<answer>1</answer> then <answer>2+3 = 5</answer>") == ("2+3", True)
    assert check_answer("3 + 5", [3, 5, 7], 8, use_all=True)[0] is False
    assert check_answer("3 + 5 * 7", [3, 5, 7], 38, use_all=True)[0] is True


def test_countdown_generation_is_deterministic_reachable_and_disjoint() -> None:
    task, again = CountdownTask(heldout_size=50), CountdownTask(heldout_size=50)
    held = {(tuple(sorted(p.metadata["nums"])), p.metadata["target"]) for p in task.prompts("test")}
    assert len(held) == 50
    for i in range(300):
        prompt = task.make_prompt(i)
        assert prompt == again.make_prompt(i)
        assert (tuple(sorted(prompt.metadata["nums"])), prompt.metadata["target"]) not in held
    for i in range(8):
        p = task.make_prompt(i, "test")
        assert _solve(p.metadata["nums"], p.metadata["target"]) is not None


def test_countdown_from_dataset_names_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "cd.jsonl"
    path.write_text(
        json.dumps({"nums": [3, 5, 7], "target": 20}) + "\n" + json.dumps({"nums": "3,5", "target": 8}) + "\n"
    )
    task = get_task("countdown", dataset=str(path))
    with pytest.raises(DatasetError, match=r"cd.jsonl: row 1: field 'nums' must be a non-empty list"):
        task.make_prompt(0)


def _solve(nums: list[int], target: int) -> str | None:
    """Brute force over orders, operations and bracketings (left-deep and pairs), enough for 3-4 numbers."""
    for k in range(1, len(nums) + 1):
        for perm in itertools.permutations(nums, k):
            for ops in itertools.product("+-*/", repeat=k - 1):
                for expr in _bracketings([str(n) for n in perm], list(ops)):
                    try:
                        if evaluate(expr)[0] == target:
                            return expr
                    except ValueError:
                        pass
    return None


def _bracketings(terms: list[str], ops: list[str]) -> list[str]:
    if len(terms) == 1:
        return terms
    out = []
    for i in range(1, len(terms)):
        for left in _bracketings(terms[:i], ops[: i - 1]):
            for right in _bracketings(terms[i:], ops[i:]):
                out.append(f"({left}{ops[i - 1]}{right})")
    return out


# ---- datasets -----------------------------------------------------------------------------------------------
def _write_saved_dataset(folder: Path, rows: list[dict]) -> None:
    """What datasets' save_to_disk writes: Arrow IPC stream files listed in state.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with (
        pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (folder / "dataset_info.json").write_text("{}")


ROWS = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 2+3?", "answer": 5}]


def test_reads_jsonl_json_parquet_arrow_and_saved_datasets(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    pq.write_table(
        pa.Table.from_pylist(ROWS[:1] + [{"prompt": "What is 2+3?", "answer": "5"}]), tmp_path / "a.parquet"
    )
    _write_saved_dataset(tmp_path / "saved", ROWS[:1] + [{"prompt": "What is 2+3?", "answer": "5"}])
    _write_saved_dataset(tmp_path / "dict" / "train", ROWS[:1])
    _write_saved_dataset(tmp_path / "dict" / "test", ROWS[1:2])
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    for name in ("a.jsonl", "a.json"):
        assert read_rows(tmp_path / name) == ROWS
    for name in ("a.parquet", "saved"):
        assert read_rows(tmp_path / name) == ROWS[:1] + [{"prompt": "What is 2+3?", "answer": "5"}]
    assert read_rows(tmp_path / "dict", split="test") == [{"prompt": "What is 2+3?", "answer": 5}]
    with pytest.raises(DatasetError, match=r"choose one with split="):
        read_rows(tmp_path / "dict")
    with pytest.raises(DatasetError, match=r"split 'dev' not found"):
        read_rows(tmp_path / "dict", split="dev")
    data = PromptDataset(tmp_path / "a.parquet")
    assert len(data) == 2 and data.item(1) == (1, "What is 2+3?", "5")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"\n',
            r"bad.jsonl: line 2: invalid JSON",
        ),
        ('{"prompt": "a", "answer": "1"}\n[1, 2]\n', r"bad.jsonl: line 2: expected a JSON object"),
        (
            '{"prompt": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n',
            r"bad.jsonl: row 1: field 'prompt' is missing",
        ),
        ('{"prompt": "  ", "answer": "1"}\n', r"bad.jsonl: row 0: field 'prompt' is an empty string"),
        ('{"prompt": "a", "answer": null}\n', r"bad.jsonl: row 0: field 'answer' is null"),
        (
            '{"prompt": "a", "answer": [1]}\n',
            r"bad.jsonl: row 0: field 'answer' must be a string or a number",
        ),
        (
            '{"prompt": [{"role": "user"}], "answer": "1"}\n',
            r"bad.jsonl: row 0: field 'prompt' message 0 needs",
        ),
    ],
)
def test_bad_jsonl_rows_name_file_row_and_field(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        len(PromptDataset(path, formatter=ChatFormatter("auto", build_tokenizer())))


def test_bad_parquet_and_arrow_rows_name_the_row(tmp_path: Path) -> None:
    rows = [{"q": "fine", "a": "1"}, {"q": "also fine", "a": "2"}, {"q": None, "a": "3"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet: row 2: field 'q' is null"):
        len(PromptDataset(tmp_path / "bad.parquet", prompt_field="q", answer_field="a"))
    _write_saved_dataset(tmp_path / "saved", rows)
    with pytest.raises(DatasetError, match=r"saved: row 2: field 'q' is null"):
        len(PromptDataset(tmp_path / "saved", prompt_field="q", answer_field="a"))
    with pytest.raises(DatasetError, match="no such file"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown format '.csv'"):
        read_rows(tmp_path / "x.csv")


def test_chat_template_when_the_dataset_asks_for_it(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    rows = [
        {
            "id": 1,
            "msgs": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
            "sol": {"value": 2},
        },
        {"id": 2, "msgs": "2+2?", "sol": {"value": 4}},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    auto = PromptDataset(path, "msgs", "sol.value", formatter=ChatFormatter("auto", tokenizer))
    assert (
        auto.item(0)[1]
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert auto.item(1) == (1, "2+2?", "4")
    always = PromptDataset(
        path, "msgs", "sol.value", formatter=ChatFormatter("always", tokenizer, system_prompt="Hi.")
    )
    assert (
        always.item(1)[1]
        == "<|im_start|>system\nHi.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(
        DatasetError, match=r"row 0: the prompt is a list of messages but chat_template='never'"
    ):
        len(PromptDataset(path, "msgs", "sol.value", formatter=ChatFormatter("never", tokenizer)))
    with pytest.raises(
        DatasetError, match=r"row 0: the prompt needs a chat template but no tokenizer was given"
    ):
        len(PromptDataset(path, "msgs", "sol.value"))
    with pytest.raises(DatasetError, match=r"row 0: field 'sol.missing' is missing"):
        len(PromptDataset(path, "msgs", "sol.missing", formatter=ChatFormatter("auto", tokenizer)))


def test_dataset_task_keeps_train_and_heldout_disjoint(tmp_path: Path) -> None:
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(5)))
    test.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in (3, 9)))
    task = get_task("dataset", dataset=str(train), test_dataset=str(test))
    assert (task.num_prompts("train"), task.num_prompts("test"), task.excluded_overlap) == (4, 2, 1)
    train_texts = {p.text for p in task.prompts("train")}
    assert train_texts == {"q0", "q1", "q2", "q4"} and not train_texts & {
        p.text for p in task.prompts("test")
    }
    last = task.make_prompt(3)
    assert (last.prompt_id, last.answer) == ("dataset/train/4", "4")
    assert task.score(last, " 4 ").reward == 1.0 and task.score(last, "5").reward == 0.0
    with pytest.raises(TaskError, match="option dataset"):
        get_task("dataset").num_prompts()
