"""Benchmarks that cannot rot (issue 37): every benchmark module's command line runs on every `make test`, in a
child process as a reader would run it, in its smoke mode (``--smoke``: the smallest shape, the same code paths
as its quick and full modes, its result written only under tmp_path). A benchmark module added without a case
here fails :func:`test_every_benchmark_module_has_a_case`.

The benchmarks made of whole ``streamrl up`` runs (minutes each, several per benchmark) run in smoke mode on one
real short run that this module records (:data:`UP_SMOKE`, ``benchmarks.common.RecordedRun``): their command lines
are checked by the config loader, their analysis reads the recorded run's files. model_scale alone has no smoke
mode (:data:`NO_SMOKE_YET`, with the reason): it is imported and its parser built (``--help``). See
docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
    "launchers": ["--smoke", "--from-run", "{run}", "--out", "{out}", "--work", "{work}"],
    "soak": ["--smoke", "--from-run", "{run}", "--out", "{out}", "--work", "{work}"],
    "vs_trl": ["--smoke", "--from-run", "{run}", "--out", "{out}"],
}
# no smoke mode yet, each with the reason: their command lines are checked (imported, --help), not run
UP_RUN = "whole `streamrl up` runs of the warm-started model, minutes each"
NO_SMOKE_YET = {
    "model_scale": "not made of up runs, and about 70 s at its smallest shape (qwen2.5-small, 12 M parameters) with "
    "the fewest sequences, requests and repeats, over a smoke's 30 s: on 2 loaded cores the learner part's 3 loads "
    "on 2 fresh gloo ranks and its plain loop's process took 50 s, the engine part 6.5 s, each sync part 6 s; "
    "tests/test_model_scale.py builds that shape",
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
    module: str, args: list[str], tmp_path: Path, run: Path | None = None
) -> subprocess.CompletedProcess:
    out, work = tmp_path / f"{module}.json", tmp_path / "work"
    argv = [a.format(out=out, work=work, run=run) for a in args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
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
    proc = run_benchmark(module, UP_SMOKE[module], tmp_path, recorded_run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / f"{module}.json").read_text())
    assert (doc["benchmark"], doc["mode"]) == (module, "smoke")
    assert doc["results"] and doc["params"]


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
