"""Benchmarks that cannot rot (issue 37): every benchmark module's command line runs on every `make test`, in a
child process as a reader would run it, in its smoke mode (``--smoke``: the smallest shape, the same code paths
as its quick and full modes, its result written only under tmp_path). A benchmark module added without a case
here fails :func:`test_every_benchmark_module_has_a_case`.

The benchmarks made of whole ``streamrl up`` runs (minutes each, several per benchmark) run in smoke mode on one
real short run that this module records (:data:`UP_SMOKE`, ``benchmarks.common.RecordedRun``): their command lines
are checked by the config loader, their analysis reads the recorded run's files. model_scale's smoke mode alone
is too slow for ``make test`` (:data:`NO_SMOKE_YET`, with the reason): there it is imported and its parser built
(``--help``), and the slow variant runs its smoke. See docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)

# module -> its smoke command's arguments; "{out}" and "{work}" become paths under tmp_path
SMOKE = {
    "broker_throughput": ["--smoke", "--out", "{out}"],
    "engine_decode": ["--smoke", "--out", "{out}"],
    "engine_throughput": ["--smoke", "--out", "{out}"],
    "learner_throughput": ["--smoke", "--out", "{out}"],
    "long_context": ["--smoke", "--out", "{out}"],
    "lora_sync": ["--smoke", "--out", "{out}"],
    "router": ["--smoke", "--out", "{out}", "--work", "{work}"],
    "weight_sync": ["--smoke", "--out", "{out}"],
}
# a background load for other measurements, not one itself: its shortest run, and no result file
LOAD = {"load": ["--seconds", "1", "--work", "{work}"]}
# run in a child process by the fast tests of their own module (not run twice)
ELSEWHERE = {
    "colocated": "tests/test_colocated_bench.py: the update part (weights by broadcast and by handle) at --tiny's "
    "shape; the whole command line with --tiny in the slow variant (it runs `streamrl up` twice)",
    "gpu_check": "tests/test_gpu_check.py: the whole command line without CUDA (exit 2 and its JSON); its parts "
    "on the CPU with --allow-cpu",
    "gpu_bundle": "tests/test_gpu_bundle.py: --plan-only and --help (the download itself needs a package index, "
    "slow variant)",
    "mini_engine": "the stand-in engine that tests/test_weight_sync_e2e.py, test_lora_sync.py and the weight_sync "
    "and colocated benchmarks start as a process",
}
# Benchmarks made of whole `streamrl up` runs: their smoke mode (benchmarks.common.RecordedRun) checks every `up`
# command line they would start with streamrl's config loader and answers each with the one real short run that
# the `recorded_run` fixture makes ("{run}"), so their own analysis and result writing run on real files.
UP_SMOKE = {
    "agentic": ["--smoke", "--from-run", "{run}", "--out", "{out}", "--work", "{work}"],
    "archive_overhead": ["--smoke", "--from-run", "{run}", "--out", "{out}", "--work", "{work}"],
    "async_vs_sync": ["--smoke", "--from-run", "{run}", "--out", "{out}"],
    "learning_gain": ["--smoke", "--from-run", "{run}", "--out", "{out}"],
    "main_job": ["--smoke", "--from-run", "{run}", "--out", "{out}", "--work", "{work}"],
    "staleness_ablation": ["--smoke", "--from-run", "{run}", "--out", "{out}", "--work", "{work}"],
    "crash_cost": ["--smoke", "--from-run", "{run}", "--out", "{out}"],
    "launchers": ["--smoke", "--from-run", "{run}", "--out", "{out}"],
    "soak": ["--smoke", "--from-run", "{run}", "--out", "{out}", "--work", "{work}"],
    "vs_trl": ["--smoke", "--from-run", "{run}", "--out", "{out}"],
}
# run without --work: their temporary directories must be gone afterwards (checked with TMPDIR under tmp_path)
LEAVE_NO_TEMPORARY = {"launchers", "vs_trl"}
# no smoke mode yet, each with the reason: their command lines are checked (imported, --help), not run
UP_RUN = "whole `streamrl up` runs of the warm-started model, minutes each"
NO_SMOKE_YET = {
    "model_scale": "its --smoke (SMOKE_SHAPE, 0.14 M parameters, every part, one repeat) takes 110 to 210 s on 2 "
    "loaded cores, over a smoke's 30 s, and a smaller shape saves nothing: the time is process starts (at load 5: "
    "the learner part's 3 loads on 2 fresh gloo ranks and its plain loop's process 60 s, the engine part 13 s, each "
    "sync part 14 s, imports and the model 7 s); run by the slow test_model_scale_smoke_runs_every_part below",
}


def benchmark_modules() -> set[str]:
    """Modules under benchmarks/ with a command line: a file with a ``main``, or a package with a __main__."""
    files = {
        p.stem for p in (REPO / "benchmarks").glob("*.py") if re.search(r"^def main\(", p.read_text(), re.M)
    }
    packages = {p.parent.name for p in (REPO / "benchmarks").glob("*/__main__.py")}
    return files | packages


def test_every_benchmark_module_has_a_case() -> None:
    cases = [*SMOKE, *UP_SMOKE, *LOAD, *ELSEWHERE, *NO_SMOKE_YET]
    assert len(cases) == len(set(cases)), "a module is listed twice"
    missing, gone = benchmark_modules() - set(cases), set(cases) - benchmark_modules()
    assert not missing, f"benchmark modules without a smoke case in {__file__}: {sorted(missing)}"
    assert not gone, f"smoke cases of modules that are no benchmark (any more): {sorted(gone)}"


def run_benchmark(
    module: str,
    args: list[str],
    tmp_path: Path,
    run: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 280,
) -> subprocess.CompletedProcess:
    out, work = tmp_path / f"{module}.json", tmp_path / "work"
    argv = [a.format(out=out, work=work, run=run) for a in args]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("module", sorted(SMOKE))
def test_smoke_mode_runs_and_writes_its_result_where_told(module: str, tmp_path: Path) -> None:
    proc = run_benchmark(module, SMOKE[module], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / f"{module}.json").read_text())
    assert (doc["benchmark"], doc["mode"]) == (module, "smoke")
    assert doc["results"] and doc["params"]


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real `streamrl up` of the untrained tiny model: 2 steps, 8 held-out prompts, a snapshot a step (vs_trl
    evaluates them) (about 40 s on 2 cores)."""
    from rollout_fleet.model import init_tiny_model

    root = tmp_path_factory.mktemp("recorded")
    model = init_tiny_model(root / "tiny")
    args = [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={root / 'run'}", f"--shared.model_path={model}",
        "--learner.max_steps=2", "--learner.wandb_mode=disabled", "--dashboard.port=0",
        "--dashboard.metrics_base_port=0", "--rollout.task.heldout_size=8", "--eval.heldout_prompts=8",
        "--eval.every_versions=1000000", "--up.status_interval_s=30", "--learner.snapshot_every=1",
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "run"


@pytest.mark.parametrize("module", sorted(UP_SMOKE))
def test_up_run_benchmarks_check_their_command_lines_and_analyse_a_real_run(
    module: str, recorded_run: Path, tmp_path: Path
) -> None:
    temporary, env = tmp_path / "tmpdir", {}
    if module in LEAVE_NO_TEMPORARY:
        temporary.mkdir()
        # Ray's session directory (its logs and sockets) stays where Ray puts it without this TMPDIR: Ray's, not
        # the benchmark's, and a socket path under tmp_path would be too long
        env = {"TMPDIR": str(temporary), "RAY_TMPDIR": os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()}
    proc = run_benchmark(module, UP_SMOKE[module], tmp_path, recorded_run, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / f"{module}.json").read_text())
    assert (doc["benchmark"], doc["mode"]) == (module, "smoke")
    assert doc["results"] and doc["params"]
    if module in LEAVE_NO_TEMPORARY:
        assert sorted(p.name for p in temporary.iterdir()) == []


def test_vs_trl_ends_the_streamrl_curve_at_the_final_policy_when_no_snapshot_is_of_it(
    recorded_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--streamrl-steps`` under the evaluation interval (5): the learner wrote no snapshot, and the curve's last
    point is the final policy the run exported (export/latest), evaluated for real, timed when it was written."""
    import shutil

    import torch

    from benchmarks import common
    from benchmarks.vs_trl.streamrl_side import run_streamrl
    from benchmarks.vs_trl.trl_side import SMOKE_SIZES, GRPORecipe

    unsnapped = tmp_path / "recorded"  # the recorded 2-step run as it is with snapshots every 5 steps
    shutil.copytree(recorded_run, unsnapped, symlinks=True, copy_function=os.link,
                    ignore=shutil.ignore_patterns("snapshots"))  # fmt: skip
    recorded = common.RecordedRun(unsnapped)
    monkeypatch.setattr(common, "SMOKE_RUN", [recorded])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the smoke's own process (trl_side.one_thread): on 2 busy cores, much faster
    try:
        recipe = GRPORecipe(steps=2, eval_every=5, **SMOKE_SIZES)
        run = run_streamrl(recorded.model(), recipe, 1, tmp_path / "run")
    finally:
        torch.set_num_threads(threads)
    final = json.loads((unsnapped / "export" / "latest" / "export.json").read_text())
    started = run["summary"]["first_request_at"] or run["summary"]["training_started_at"]
    assert [(p["step"], p["samples"]) for p in run["curve"]] == [(0, 0), (2, 2 * 2 * 2)]
    assert run["curve"][-1]["wall_seconds"] == round(final["time"] - started, 3)


def test_a_benchmarks_refused_command_line_fails_its_smoke_run(recorded_run: Path, tmp_path: Path) -> None:
    """A field the config refuses, in what an up-run benchmark would start, fails the smoke run naming it."""
    from benchmarks.common import RecordedRun

    recorded = RecordedRun(recorded_run)
    with pytest.raises(SystemExit, match="learner.no_such_field"):
        recorded.check(["python", "-m", "streamrl", "up", "--learner.no_such_field=1"])
    with pytest.raises(SystemExit, match="shared.eta"):
        recorded.answer(["--shared.eta=-1"], tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_the_load_runs_its_shortest_round(tmp_path: Path) -> None:
    proc = run_benchmark("load", LOAD["load"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "'rounds':" in proc.stdout and (tmp_path / "work").is_dir()


def test_the_benchmarks_without_a_smoke_mode_import_and_parse_their_command_lines() -> None:
    """Each module imported and its parser built (``--help``), in one child process: a name one of them imports
    that no longer exists, or a broken parser, fails here."""
    code = (
        "import contextlib, importlib, io, sys\n"
        "for name in sys.argv[1:]:\n"
        "    module = importlib.import_module(f'benchmarks.{name}' + ('.__main__' if name == 'vs_trl' else ''))\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as text:\n"
        "        try:\n"
        "            module.main(['--help'])\n"
        "        except SystemExit as exit_:\n"
        "            assert exit_.code == 0, (name, exit_.code)\n"
        "    assert '--out' in text.getvalue(), name\n"
        "    print('ok', name)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code, *NO_SMOKE_YET],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.split() == [w for name in NO_SMOKE_YET for w in ("ok", name)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_model_scale_smoke_runs_every_part_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """model_scale's --smoke (in NO_SMOKE_YET: too slow for make test): every part's headline written, the model
    built in its own temporary directory (nothing in the model cache), nothing left in TMPDIR but torch's
    compile cache (torchinductor_USER, torch's own, kept across runs by design)."""
    temporary, cache = tmp_path / "tmpdir", tmp_path / "cache"
    temporary.mkdir()
    env = {"TMPDIR": str(temporary), "STREAMRL_CACHE": str(cache)}
    proc = run_benchmark("model_scale", ["--smoke", "--out", "{out}"], tmp_path, env=env, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "model_scale.json").read_text())
    assert (doc["benchmark"], doc["mode"], doc["params"]["shape"]) == ("model_scale", "smoke", "smoke")
    every_part = (
        "ratio_load_peak_whole_vs_sharded", "load_seconds_broadcast", "ratio_train_learner_vs_plain",
        "ratio_checkpoint_wait_sync_vs_async", "ratio_engine_vs_hf_generate", "ratio_sync_full_vs_adapter",
        "ratio_sync_bf16_full_vs_adapter",
    )  # fmt: skip
    assert [k for k in every_part if not doc.get(k)] == []
    left = [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")]
    assert not cache.exists() and left == []


@pytest.mark.parametrize(
    "where", ["benchmarks/results/broker_throughput.json", "runs/broker_throughput.json"]
)
def test_a_smoke_run_refuses_to_write_into_the_checkout(
    where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.broker_throughput import main  # no torch to import

    target = REPO / where
    before = target.stat().st_mtime_ns if target.exists() else None
    with pytest.raises(SystemExit) as exit_:
        main(["--smoke", "--out", str(target)])
    assert exit_.value.code == 2 and "--smoke writes only outside the checkout" in capsys.readouterr().err
    assert (target.stat().st_mtime_ns if target.exists() else None) == before


def test_the_json_baseline_carries_every_field_of_a_multi_turn_record() -> None:
    """broker_throughput's JSON codec (its baseline) round-trips a schema v2 record, arrays as lists: the same
    record, byte for byte in the real codec."""
    import dataclasses

    import numpy as np

    from benchmarks.broker_throughput import json_decode, json_encode
    from broker.codec import encode
    from broker.record import synthetic_group

    group = synthetic_group(np.random.default_rng(0), num_samples=2, num_tokens=6, version=3)
    turns = np.array([0, 2, 4, 6], dtype=np.int32)
    mask = np.array([1, 1, 0, 0, 1, 1], dtype=np.uint8)  # the observation between the turns is not trained
    samples = [
        dataclasses.replace(s, turn_bounds=turns, loss_mask=mask, episode={"turns": 2.0})
        for s in group.samples
    ]
    group = dataclasses.replace(group, samples=samples, schema_version=0)
    assert group.schema_version == 2
    payload = json_encode(group)
    assert b'"turn_bounds": [0, 2, 4, 6]' in payload
    assert encode(json_decode(payload)) == encode(group)
