"""The benchmarks' pure parts: target and time-to-target arithmetic, the SVG plot, the training clock, and the
`streamrl up` command lines the benchmarks build (every option must exist in the config tree)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks import async_vs_sync
from benchmarks.plot import figure, line_chart
from benchmarks.vs_trl.__main__ import final_reward_of, first_reaching, noise, side_summary
from benchmarks.vs_trl.streamrl_side import up_command
from benchmarks.vs_trl.trl_side import Curve, GRPORecipe, TrainingClock
from common.configlib import load_config
from streamrl.config import StreamRLConfig


def curve(*points: tuple[int, float, float]) -> list[dict[str, float]]:
    c = Curve()
    for step, wall, greedy in points:
        c.add(step, step * 64, wall, {"greedy_accuracy": greedy, "sampled_accuracy": greedy / 2})
    return c.points


def test_final_reward_is_the_mean_of_the_last_two_evaluations() -> None:
    assert final_reward_of(curve((0, 0, 0.4), (5, 4, 0.6), (10, 8, 0.7))) == pytest.approx(0.65)


def test_time_to_target_is_the_first_point_at_or_above_it_and_ignores_the_start() -> None:
    c = curve((0, 0.0, 0.9), (5, 4.0, 0.5), (10, 8.0, 0.66), (15, 12.0, 0.7))
    assert first_reaching(c, 0.65)["wall_seconds"] == 8.0
    s = side_summary(c, 0.65)
    assert (s["time_to_target"], s["samples_to_target"], s["last_evaluation"]) == (8.0, 640, 0.7)
    assert s["final_reward"] == pytest.approx(0.68)  # 0.66 and 0.7
    assert side_summary(c, 0.95)["time_to_target"] is None


def test_noise_is_two_standard_errors() -> None:
    assert noise(0.5, 100) == pytest.approx(0.1)


def test_seed_noise_is_two_standard_errors_of_the_difference_of_means() -> None:
    from benchmarks.vs_trl.__main__ import seed_noise

    # variances 0.01 and 0.04 over 2 seeds each: 2 * sqrt(0.01 / 2 + 0.04 / 2) = 2 * sqrt(0.025)
    assert seed_noise([0.5, 0.5 + 0.1 * 2**0.5], [0.3, 0.3 + 0.2 * 2**0.5]) == pytest.approx(2 * 0.025**0.5)
    assert seed_noise([0.5], [0.4, 0.6]) is None


def test_plot_is_valid_svg_with_one_line_per_series(tmp_path: Path) -> None:
    chart = line_chart({"a": [(0, 0.1), (5, 0.5)], "b": [(0, 0.2), (10, 0.3)]}, "t", "x", "y", (0, 1))
    root = ET.fromstring(figure([chart, chart]))
    lines = root.findall(".//{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 4
    assert root.get("width") == "840"


def test_training_clock_excludes_paused_time() -> None:
    ticks = iter([10.0, 11.0, 15.0, 16.5])  # start, pause begins, pause ends, read
    clock = TrainingClock(now=lambda: next(ticks))
    clock.start()
    with clock.paused():
        pass
    assert clock.elapsed() == 2.5  # 6.5 s since start, 4 of them paused


@pytest.mark.parametrize("eta", [0, 2])
def test_vs_trl_command_line_is_a_valid_streamrl_config(tmp_path: Path, eta: int) -> None:
    recipe = GRPORecipe(steps=7, prompts_per_step=4, group_size=6, lr=3e-5, max_new_tokens=50, eval_every=3)
    argv = up_command(recipe, eta, tmp_path / "run", tmp_path / "model")
    assert argv[1:4] == ["-m", "streamrl", "up"]
    cfg = load_config(StreamRLConfig, argv[4:])
    assert (cfg.shared.eta, cfg.learner.max_steps, cfg.learner.groups_per_step) == (eta, 7, 4)
    assert (cfg.rollout.group_size, cfg.learner.lr, cfg.rollout.max_new_tokens) == (6, 3e-5, 50)
    assert (cfg.learner.snapshot_every, cfg.learner.loss.eps_high) == (3, 0.2)
    assert cfg.learner.keep_snapshots >= 7 // 3  # every snapshot of the curve is kept (steps 3 and 6)
    # the deployment: one engine holding a whole step's samples, one learner rank, no live evaluator
    assert (cfg.engine.count, cfg.engine.max_running_requests, cfg.learner.world_size) == (1, 24, 1)
    assert (cfg.learner.micro_batch_tokens, cfg.eval.every_versions) == (2048, 0)


def test_async_vs_sync_command_line_changes_only_eta_and_seed(tmp_path: Path, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(async_vs_sync.subprocess, "run", lambda args, **kw: seen.append(args) or _Done())
    (tmp_path / "summary.json").write_text("{}")
    for eta in (0, 4):
        async_vs_sync.run_up(tmp_path, eta, 9, tmp_path / "model", seed=1)
    a, b = (load_config(StreamRLConfig, argv[4:]) for argv in seen)
    assert (a.shared.eta, b.shared.eta) == (0, 4)
    a.shared.eta = b.shared.eta
    assert a == b
    assert (a.learner.max_steps, a.learner.seed, a.rollout.shuffle_seed) == (9, 1, 1)


class _Done:
    returncode = 0
    stdout = ""


def test_mean_curve_averages_seeds_point_by_point() -> None:
    from benchmarks.vs_trl.__main__ import mean_curve

    a, b = curve((0, 0.0, 0.4), (5, 4.0, 0.6)), curve((0, 0.0, 0.4), (5, 6.0, 0.5))
    assert mean_curve([a, b]) == [
        {"step": 0, "samples": 0, "wall_seconds": 0.0, "greedy": 0.4, "sampled": 0.2},
        {"step": 5, "samples": 320, "wall_seconds": 5.0, "greedy": 0.55, "sampled": 0.275},
    ]


def _result_file(
    tmp_path: Path,
    name: str,
    seeds: list[int],
    trl: list,
    ours: list,
    model: str = "warm",
    model_sha256: str | None = None,
) -> Path:
    """A vs_trl result written by ``summarise`` itself from hand-made per-seed curves."""
    from benchmarks.vs_trl.__main__ import summarise

    params = {"recipe": {"heldout": 100, "steps": 10}, "eta": 1, "seeds": seeds, "model": model}
    if model_sha256:
        params["model_sha256"] = model_sha256
    runs = {
        "mode": "full",
        "params": params,
        "curves_per_seed": {"TRL": trl, "streamrl eta=0": ours, "streamrl eta=1": ours},
        "streamrl_runs": {"0": [{"seed": s} for s in seeds], "1": [{"seed": s} for s in seeds]},
    }
    out = tmp_path / name
    summarise(runs, out)
    return out


def test_summary_pools_seeds_from_result_files_and_recomputes_the_ratio(tmp_path: Path) -> None:
    import json

    from benchmarks.vs_trl.__main__ import main

    trl = [curve((0, 0, 0.4), (5, 10, 0.5), (10, 20, 0.6))]
    first = _result_file(tmp_path, "a.json", [0], trl, [curve((0, 0, 0.4), (5, 4, 0.6), (10, 8, 0.6))])
    second = _result_file(tmp_path, "b.json", [1], trl, [curve((0, 0, 0.4), (5, 6, 0.4), (10, 12, 0.5))])
    assert json.loads(first.read_text())["time_to_target_ratio"] == pytest.approx(20 / 4)
    assert main(["--from-json", str(first), str(second), "--out", str(tmp_path / "pooled.json")]) == 0
    doc = json.loads((tmp_path / "pooled.json").read_text())
    # pooled: target = mean of TRL's last two = 0.55; streamrl's mean is 0.5 at 5 s and 0.55 at 10 s: 20 / 10
    assert doc["params"]["seeds"] == [0, 1]
    assert doc["target_reward"] == pytest.approx(0.55)
    assert doc["time_to_target_ratio"] == pytest.approx(2.0)
    assert doc["per_step_speed_ratio"] == pytest.approx(2.0)
    # finals (mean of the last two): 0.6, 0.45 against TRL's 0.55, 0.55: 2 * sqrt(0.01125 / 2 + 0)
    assert doc["final_reward_seed_noise"] == pytest.approx(2 * (0.01125 / 2) ** 0.5)
    assert len(doc["results"]["streamrl_runs"]["1"]) == 2
    assert (tmp_path / "pooled.svg").exists()


def test_streamrl_may_train_past_trl_and_its_reward_at_trl_samples_is_reported(tmp_path: Path) -> None:
    import json

    from benchmarks.vs_trl.__main__ import default_streamrl_steps

    assert [default_streamrl_steps(n) for n in (60, 30, 25)] == [90, 45, 40]
    trl = [curve((0, 0, 0.4), (5, 10, 0.5), (10, 20, 0.7))]  # target 0.6
    ours = [curve((0, 0, 0.4), (5, 4, 0.5), (10, 8, 0.55), (15, 12, 0.62))]
    doc = json.loads(_result_file(tmp_path, "a.json", [0], trl, ours).read_text())
    assert doc["time_to_target_ratio"] == pytest.approx(20 / 12)  # reached at step 15, past TRL's 10
    assert doc["streamrl_final_step"] == 15
    assert doc["streamrl_final_reward"] == pytest.approx(0.585)  # steps 10 and 15
    assert doc["streamrl_reward_at_trl_samples"] == 0.55  # step 10: TRL's 640 samples
    assert doc["results"]["sides"]["TRL"]["reward_at_trl_samples"] == 0.7
    # per sample: the mean over evaluations stops at TRL's sample count on every side
    assert doc["results"]["sides"]["streamrl eta=1"]["mean_reward_over_evaluations"] == pytest.approx(0.525)


def test_runs_shorter_than_the_evaluation_interval_are_summarised_at_their_final_policy(
    tmp_path: Path,
) -> None:
    """--steps 2 --streamrl-steps 3 (both under 5): each side's curve is its start and its final policy."""
    import json

    trl = [curve((0, 0, 0.4), (2, 10, 0.5))]
    ours = [curve((0, 0, 0.4), (3, 6, 0.6))]  # its one evaluation lies past TRL's sample count
    doc = json.loads(_result_file(tmp_path, "a.json", [0], trl, ours).read_text())
    assert (doc["trl_final_reward"], doc["streamrl_final_reward"]) == (
        0.5,
        0.6,
    )  # not averaged with the start
    assert doc["streamrl_final_step"] == 3 and doc["per_step_speed_ratio"] == pytest.approx(5 / 2)
    assert doc["results"]["sides"]["streamrl eta=1"]["mean_reward_over_evaluations"] is None
    assert doc["time_to_target_ratio"] == pytest.approx(10 / 6)


def test_the_final_reward_margin_measures_both_sides_the_way_the_target_measures_trl(tmp_path: Path) -> None:
    import json

    # TRL ends on a high draw (0.5 then 0.7: final 0.6); streamrl ends 0.62 then 0.6 (final 0.61). Against TRL's
    # last evaluation alone streamrl would look 0.1 worse though it reached TRL's final reward.
    trl = [curve((0, 0, 0.4), (5, 10, 0.5), (10, 20, 0.7))]
    ours = [curve((0, 0, 0.4), (5, 4, 0.5), (10, 8, 0.62), (15, 12, 0.6))]
    doc = json.loads(_result_file(tmp_path, "a.json", [0], trl, ours).read_text())
    assert doc["trl_final_reward"] == doc["target_reward"] == pytest.approx(0.6)
    assert doc["streamrl_final_reward"] == pytest.approx(0.61)
    eval_noise = noise(0.6, 100)
    assert doc["final_reward_margin_over_noise"] == pytest.approx(0.01 + eval_noise)
    assert doc["last_evaluation_margin_over_noise"] == pytest.approx(0.6 - 0.7 + eval_noise)
    assert doc["passed"]


def test_pooling_refuses_a_seed_twice_and_another_model(tmp_path: Path) -> None:
    from benchmarks.vs_trl.__main__ import main

    trl = [curve((0, 0, 0.4), (5, 10, 0.5))]
    a = _result_file(tmp_path, "a.json", [3], trl, [curve((0, 0, 0.4), (5, 4, 0.6))])
    with pytest.raises(SystemExit, match="seed appears twice"):
        main(["--from-json", str(a), str(a), "--out", str(tmp_path / "p.json")])
    other = _result_file(tmp_path, "b.json", [4], trl, [curve((0, 0, 0.4), (5, 4, 0.6))], model="other")
    with pytest.raises(SystemExit, match="model differs"):
        main(["--from-json", str(a), str(other), "--out", str(tmp_path / "p.json")])


def test_heldout_task_extends_the_default_test_split_and_leaves_training_alone() -> None:
    from benchmarks.vs_trl.trl_side import heldout_task
    from rollout_fleet.tasks import get_task

    default, large = get_task("arithmetic"), heldout_task(1000)
    assert large.num_prompts("test") == 1000 and default.num_prompts("test") == 200
    assert [large.make_prompt(i, "test").text for i in range(200)] == [
        default.make_prompt(i, "test").text for i in range(200)
    ]
    assert [large.make_prompt(i).text for i in range(0, 100_000, 4999)] == [
        default.make_prompt(i).text for i in range(0, 100_000, 4999)
    ]


def test_keep_runs_leaves_the_run_directories_and_refuses_a_used_one(tmp_path: Path) -> None:
    from benchmarks.vs_trl.__main__ import runs_directory

    with runs_directory(None) as tmp:
        (Path(tmp) / "s0-eta1").mkdir()
    assert not Path(tmp).exists()
    kept = tmp_path / "kept"
    with runs_directory(kept) as where:
        (Path(where) / "s0-eta1").mkdir()
    assert (kept / "s0-eta1").is_dir()
    with pytest.raises(SystemExit, match="not empty"), runs_directory(kept):
        pass


def test_pooling_refuses_the_same_model_path_with_other_weights(tmp_path: Path) -> None:
    from benchmarks.vs_trl.__main__ import main, model_fingerprint

    model = tmp_path / "warm"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights one")
    first = model_fingerprint(model)
    (model / "model.safetensors").write_bytes(b"weights two")
    assert model_fingerprint(model) != first
    trl = [curve((0, 0, 0.4), (5, 10, 0.5))]
    ours = [curve((0, 0, 0.4), (5, 4, 0.6))]
    a = _result_file(tmp_path, "a.json", [0], trl, ours, model_sha256=first)
    b = _result_file(tmp_path, "b.json", [1], trl, ours, model_sha256=model_fingerprint(model))
    with pytest.raises(SystemExit, match="model_sha256 differs"):
        main(["--from-json", str(a), str(b), "--out", str(tmp_path / "p.json")])
    old = _result_file(tmp_path, "old.json", [2], trl, ours)  # written before the fingerprint: no check
    assert main(["--from-json", str(a), str(old), "--out", str(tmp_path / "p.json")]) == 0


def test_staleness_ablation_cells_differences_and_targets_by_hand() -> None:
    from benchmarks.staleness_ablation import cell_stats, headline

    # seeds 0.6, 0.7, 0.8: mean 0.7, stdev 0.1, se 0.1 / sqrt 3 = 0.057735
    three = cell_stats([0.6, 0.7, 0.8], 1000)
    assert three["mean"] == pytest.approx(0.7) and three["se"] == pytest.approx(0.0577350)
    # one seed: the evaluation's binomial se sqrt(0.5 x 0.5 / 1000) = 0.0158114
    one = cell_stats([0.5], 1000)
    assert one["se"] == pytest.approx(0.0158114) and one["se_kind"].startswith("binomial")

    def cell(mean: float, se: float) -> dict:
        return {"mean": mean, "se": se}

    table = {  # the "default" is decoupled PPO with its trust region
        "decoupled": {"0": cell(0.70, 0.03), "4": cell(0.64, 0.04), "8": cell(0.60, 0.03)},
        "none": {"0": cell(0.70, 0.03), "4": cell(0.55, 0.03), "8": cell(0.40, 0.04)},
    }
    h = headline(table)
    assert h["reward_eta4_minus_eta0_default"] == pytest.approx(-0.06)
    assert h["reward_eta8_minus_eta0_none"] == pytest.approx(-0.30)
    # default eta 4 - eta 0 = -0.06, se sqrt(0.03^2 + 0.04^2) = 0.05: margin -0.06 + 0.10 = 0.04 (met)
    assert h["default_eta4_margin"] == pytest.approx(0.04)
    # default - none at eta 8 = 0.20, se 0.05: gap 0.20 - 0.10 = 0.10 (met)
    assert h["none_eta8_gap"] == pytest.approx(0.10)
    # none (the shipped default) eta 4 - eta 0 = -0.15, se sqrt(0.03^2 + 0.03^2) = 0.042426: -0.065147 (not met)
    assert h["none_eta4_margin"] == pytest.approx(-0.15 + 2 * 0.0424264)
    assert (h["issue_default"], h["shipped_default"]) == ("decoupled", "none")
    assert headline({"decoupled": {"0": cell(0.7, 0.01)}})["none_eta8_gap"] is None


def test_staleness_ablation_command_lines_are_valid_configs(tmp_path: Path, monkeypatch) -> None:
    from benchmarks import staleness_ablation

    seen = []
    monkeypatch.setattr(async_vs_sync.subprocess, "run", lambda args, **kw: seen.append(args) or _Done())
    monkeypatch.setattr(async_vs_sync, "one_run", lambda summary: {"eval_reward": 0.5})
    monkeypatch.setattr(staleness_ablation, "one_run", lambda summary: {"eval_reward": 0.5})
    for corr in staleness_ablation.CORRECTIONS:
        key = staleness_ablation.run_key(8, corr, 2, 5, ["--learner.ppo_minibatches=2"])
        run_dir = tmp_path / "runs" / f"eta8-{corr}-s2"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text("{}")
        staleness_ablation.cached_run(tmp_path, key, tmp_path / "model", "shared")
        assert staleness_ablation.cached_run(tmp_path, key, tmp_path / "model", "shared") == {
            "eval_reward": 0.5
        }
    assert len(seen) == len(staleness_ablation.CORRECTIONS)  # the second call of each came from --work
    configs = {
        c: load_config(StreamRLConfig, argv[4:])
        for c, argv in zip(staleness_ablation.CORRECTIONS, seen, strict=True)
    }
    assert {c: cfg.learner.loss.policy_loss for c, cfg in configs.items()} == {
        "decoupled": "decoupled_ppo", "none": "ppo", "tis": "tis", "icepop": "icepop", "decoupled_m1": "decoupled_ppo",
    }  # fmt: skip
    assert configs["decoupled"].learner.lr == configs["none"].learner.lr / 2
    for cfg in configs.values():
        assert (cfg.shared.eta, cfg.learner.max_steps, cfg.learner.ppo_minibatches) == (8, 5, 2)
        assert cfg.eval.heldout_prompts == 1000 and cfg.rollout.task.heldout_size == 1000


def test_archive_overhead_runs_differ_only_in_the_archive_and_count_rows(tmp_path: Path, monkeypatch) -> None:
    from archiver.archive import rejected_row, write_rows
    from benchmarks import archive_overhead
    from broker.consumer import Rejected

    seen = []
    summary = {
        "learner_train_seconds": 6.0,
        "learner_wait_seconds": 3.0,
        "steps": 3,
        "audit": {"produced": 1},
        "training_wall_seconds": 10.0,
        "archive": {"cpu_s": 0.8},
    }

    def fake_run(args, **kw):  # noqa: ANN001, ANN202
        seen.append(args)
        run_dir = Path(next(a for a in args if a.startswith("--shared.run_dir=")).split("=", 1)[1])
        (run_dir / "archive").mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        rows = [rejected_row(Rejected(f"{i}-0", f"g{i}", "decode", "x"), "r", 0.0) for i in range(8)]
        write_rows(run_dir / "archive" / "part-000000.parquet", rows)
        return _Done()

    monkeypatch.setattr(async_vs_sync.subprocess, "run", fake_run)
    on = archive_overhead.one(tmp_path / "on", 3, tmp_path / "model", archive=True)
    off = archive_overhead.one(tmp_path / "off", 3, tmp_path / "model", archive=False)
    assert on["learner_step_seconds"] == 2.0 and on["step_wall_seconds"] == 3.0
    assert on["archive_rows"] == on["samples_generated"] == 8 and on["rows_equal_generated"] is True
    assert "archive_rows" not in off
    # the archiver's CPU seconds against what the cores offered while training ran
    assert on["archiver_cpu_seconds"] == 0.8
    assert on["archiver_cpu_share"] == pytest.approx(0.8 / (10.0 * os.cpu_count()))
    configs = [load_config(StreamRLConfig, argv[4:]) for argv in seen]
    assert [c.archive.enabled for c in configs] == [True, False]
    assert configs[0].model_dump(exclude={"archive", "shared"}) == configs[1].model_dump(
        exclude={"archive", "shared"}
    )


def test_one_in_a_thousand_bounds_by_hand() -> None:
    """[1, 2, 3, 4, 5]: mean 3, sd sqrt(2.5); normal bound 3 -/+ 3.09 sd; t bound (4 degrees of freedom, 7.173)
    3 -/+ 7.173 sd sqrt(1 + 1/5)."""
    from benchmarks.common import one_in_a_thousand

    lower = one_in_a_thousand("gain", [1, 2, 3, 4, 5])
    assert lower["gain_mean"] == 3 and lower["gain_sd"] == pytest.approx(2.5**0.5)
    assert (lower["gain_min"], lower["gain_max"]) == (1, 5)
    assert lower["gain_threshold_one_in_a_thousand"] == pytest.approx(-1.8857190, abs=1e-6)
    assert lower["gain_t_prediction_one_in_a_thousand"] == pytest.approx(-9.4240004, abs=1e-6)
    upper = one_in_a_thousand("cost", [1, 2, 3, 4, 5], side="upper")
    assert upper["cost_threshold_one_in_a_thousand"] == pytest.approx(7.8857190, abs=1e-6)
    assert upper["cost_t_prediction_one_in_a_thousand"] == pytest.approx(15.4240004, abs=1e-6)
    assert "x_t_prediction_one_in_a_thousand" not in one_in_a_thousand("x", [1, 2, 3])  # no t quantile for 2
    with pytest.raises(ValueError, match="side = 'both'"):
        one_in_a_thousand("x", [1, 2], side="both")
