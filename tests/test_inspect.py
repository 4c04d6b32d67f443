"""`streamrl inspect` over an archive written by the archiver's own writer: the tables' numbers by hand, the
filters, the export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from archiver.archive import TokenText, rejected_row, sample_rows, write_rows
from broker.consumer import Rejected
from broker.outcomes import Outcome
from broker.record import synthetic_group
from streamrl.inspect import main, reward_windows, staleness_histogram
from streamrl.summary import upgrade_summary


def _archive(run_dir: Path) -> None:
    """Four groups of 2 samples (rewards 0 and 1 each: synthetic_group's), decided at steps 1, 2, 2 and 3, one
    dropped as stale; one pending group; one rejected entry."""
    rng = np.random.default_rng(0)
    text = TokenText(None)
    rows = []
    decided = [
        (0, Outcome("trained", step=1, learner_version=1)),  # versions 0: staleness 1
        (1, Outcome("trained", step=2, learner_version=3)),  # versions 1: staleness 2
        (2, Outcome("dropped", step=2, reason="stale", learner_version=3)),
        (3, Outcome("trained", step=3, learner_version=3)),  # versions 0: staleness 3
    ]
    for i, outcome in decided:
        g = synthetic_group(
            rng, run_id="r", prompt_index=i, num_samples=2, num_tokens=4, version=i % 2 if i != 3 else 0
        )
        rows += sample_rows(g, f"{i}-0", outcome, text, 0.0)
    rows.append(rejected_row(Rejected("9-0", "r:junk", "decode", "not msgpack"), "r", 0.0))
    (run_dir / "archive").mkdir(parents=True)
    write_rows(run_dir / "archive" / "part-000000.parquet", rows)
    pending = synthetic_group(rng, run_id="r", prompt_index=7, num_samples=2, num_tokens=4)
    write_rows(run_dir / "archive" / "pending.parquet", sample_rows(pending, "7-0", None, text, 0.0))


def _run(*args: str) -> tuple[int, str]:
    console = Console(record=True, width=250)
    code = main(list(args), console=console)
    return code, console.export_text()


def test_reward_windows_and_staleness_by_hand() -> None:
    rows = [
        {"outcome": "trained", "outcome_step": 1, "reward": 1.0, "num_tokens": 4, "finish_reason": "stop",
         "reward_components": [{"name": "correct", "value": 1.0}], "staleness_max": 1},
        {"outcome": "trained", "outcome_step": 2, "reward": 0.0, "num_tokens": 8, "finish_reason": "length",
         "reward_components": [{"name": "correct", "value": 0.0}], "staleness_max": 1},
        {"outcome": "dropped", "outcome_step": 4, "reward": 0.5, "num_tokens": 6, "finish_reason": "stop",
         "reward_components": [], "staleness_max": None},
        {"outcome": "pending", "outcome_step": None, "reward": 1.0, "num_tokens": 1, "finish_reason": "stop",
         "reward_components": [], "staleness_max": None},
    ]  # fmt: skip
    header, body = reward_windows(rows, window=2)
    assert header == ["steps", "samples", "reward", "correct", "tokens", "cut"]
    # steps 1-2: rewards 1 and 0, correct 1 and 0, tokens 4 and 8, one of two cut; steps 3-4: the drop alone
    assert body == [["1-2", "2", "0.500", "0.500", "6", "50.0%"], ["3-4", "1", "0.500", "0.000", "6", "0.0%"]]
    assert staleness_histogram(rows) == [(1, 2)]


def test_inspect_shows_filters_and_exports(tmp_path: Path) -> None:
    _archive(tmp_path)
    code, out = _run(str(tmp_path), "--samples", "1")
    assert code == 0
    assert "samples / groups" in out and "11 / 6 (11 samples selected)" in out  # 4x2 + 2 pending + 1 rejected
    part_bytes = (tmp_path / "archive" / "part-000000.parquet").stat().st_size
    (line,) = [x for x in out.splitlines() if "bytes per sample" in x]
    assert f"│ {part_bytes / 9:.0f} (in the parts)" in line  # the part's 9 rows, not the pending snapshot's
    assert "dead_lettered 1, dropped 2, pending 2, trained 6" in out and "stale 2" in out
    # staleness of trained samples: 2 at 1 (step 1), 2 at 2 (step 2), 2 at 3 (step 3)
    hist = [line.split() for line in out.splitlines() if line.strip().startswith("│") and "###" in line]
    assert [(cells[1], cells[3]) for cells in hist] == [("1", "2"), ("2", "2"), ("3", "2")]
    assert "best samples" in out and "worst samples" in out and "random samples" in out

    export = tmp_path / "out" / "stale.jsonl"
    code, out = _run(str(tmp_path), "--outcome", "dropped", "--reason", "stale", "--export", str(export))
    rows = [json.loads(line) for line in export.read_text().splitlines()]
    assert code == 0 and len(rows) == 2 and {r["group_id"] for r in rows} == {"r:e0:p2:a0"}
    assert rows[0]["completion_ids"] and rows[0]["reward_components"]  # every column

    code, _ = _run(str(tmp_path), "--steps", "2:3", "--min-reward", "1", "--export", str(export))
    rows = [json.loads(line) for line in export.read_text().splitlines()]
    assert sorted((r["outcome_step"], r["reward"]) for r in rows) == [(2, 1.0), (2, 1.0), (3, 1.0)]
    code, _ = _run(str(tmp_path), "--no-pending", "--export", str(export))
    assert all(json.loads(line)["outcome"] != "pending" for line in export.read_text().splitlines())


def test_inspect_reads_summaries_of_either_naming(tmp_path: Path) -> None:
    """summary.json's greedy accuracy was eval_reward_*; a run directory written then shows the same rows."""
    _archive(tmp_path)
    for name, before, after in (("eval_reward", 0.25, 0.5), ("eval_greedy_accuracy", 0.125, 0.75)):
        (tmp_path / "summary.json").write_text(json.dumps({f"{name}_before": before, f"{name}_after": after}))
        code, out = _run(str(tmp_path), "--samples", "0")
        rows = {cells[1]: cells[3] for cells in (line.split() for line in out.splitlines()) if len(cells) > 3}
        assert code == 0
        assert (rows["eval_greedy_accuracy_before"], rows["eval_greedy_accuracy_after"]) == (
            str(before),
            str(after),
        )


def test_upgrade_summary_renames_only_the_old_accuracy_fields() -> None:
    old = {
        "eval_reward_before": 0.1,
        "eval_sampled_after": 0.3,
        "eval_reward": {"source": "task"},
        "steps": 4,
    }
    assert upgrade_summary(old) == {
        "eval_greedy_accuracy_before": 0.1,
        "eval_sampled_accuracy_after": 0.3,
        "eval_reward": {"source": "task"},  # which reward scored the evaluations: not an accuracy, kept
        "steps": 4,
    }
    new = {"eval_greedy_accuracy_after": 0.5}
    assert upgrade_summary(new) == new


def test_inspect_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as err:
        main([str(tmp_path), "--steps", "5:2"])
    assert err.value.code == 2 and "--steps '5:2': the range is empty (5 > 2)" in capsys.readouterr().err
    code, out = _run(str(tmp_path / "nothing"))
    assert code == 2 and "no archive at" in out
