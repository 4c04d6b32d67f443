"""The device plan (streamrl.devices): which GPUs every process of a run sees, for 1, 2, 4 and 8 GPUs in both
placements; the plans that cannot work refused before anything starts, naming the fields and the numbers; and
the environment every spawned process really has, read back from /proc."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.configlib import ConfigError
from streamrl import devices
from streamrl.config import StreamRLConfig
from streamrl.devices import parse_devices, plan_for, resolve_plan
from streamrl.up import child_specs

GPUS = {n: [str(i) for i in range(n)] for n in (1, 2, 4, 8)}

# (GPUs, placement, learner ranks, engines, GPUs per engine) -> (learner's GPUs, each engine's GPUs)
PLANS = {
    (1, "colocated", 1, 1, 1): ("0", ["0"]),
    (2, "disaggregated", 1, 1, 1): ("0", ["1"]),
    (2, "colocated", 2, 2, 1): ("0,1", ["0", "1"]),
    (2, "colocated", 2, 1, 2): ("0,1", ["0,1"]),
    (4, "disaggregated", 2, 2, 1): ("0,1", ["2", "3"]),
    (4, "disaggregated", 2, 1, 2): ("0,1", ["2,3"]),
    (4, "colocated", 4, 2, 2): ("0,1,2,3", ["0,1", "2,3"]),
    (8, "disaggregated", 4, 2, 2): ("0,1,2,3", ["4,5", "6,7"]),
    (8, "disaggregated", 2, 3, 2): ("0,1", ["2,3", "4,5", "6,7"]),
    (8, "colocated", 8, 4, 2): ("0,1,2,3,4,5,6,7", ["0,1", "2,3", "4,5", "6,7"]),
    (8, "colocated", 8, 1, 8): ("0,1,2,3,4,5,6,7", ["0,1,2,3,4,5,6,7"]),
}


@pytest.mark.parametrize(("shape", "expected"), PLANS.items(), ids=lambda v: str(v))
def test_plan_gives_each_role_its_gpus(shape: tuple, expected: tuple) -> None:
    n, placement, ranks, engines, per_engine = shape
    plan = resolve_plan(GPUS[n], placement, ranks, engines, per_engine)
    assert plan.learner_env() == {"CUDA_VISIBLE_DEVICES": expected[0]}
    assert [plan.engine_env(i)["CUDA_VISIBLE_DEVICES"] for i in range(engines)] == expected[1]
    assert plan.no_gpu_env() == {"CUDA_VISIBLE_DEVICES": ""}
    # disaggregated: no GPU is shared; colocated: every engine GPU is a learner GPU
    learner, engine_gpus = set(plan.learner), [g for e in plan.engines for g in e]
    assert len(engine_gpus) == len(set(engine_gpus)) == engines * per_engine
    if placement == "disaggregated":
        assert not learner & set(engine_gpus)
    else:
        assert set(engine_gpus) <= learner
    assert plan.sglang_args() == ["--base-gpu-id", "0", "--tp-size", str(per_engine)]
    doc = plan.to_json()
    assert doc["device"] == "cuda" and doc["visible"] == GPUS[n]
    assert doc["unused"] == [g for g in GPUS[n] if g not in learner | set(engine_gpus)]


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ((1, "disaggregated", 1, 1, 1), ["learner.world_size + engine.count", "= 2 GPUs", "gives 1 (0)"]),
        ((4, "disaggregated", 2, 2, 2), ["2 + 2 x 2 = 6 GPUs", "gives 4", "shared.placement = colocated"]),
        ((8, "disaggregated", 8, 1, 1), ["8 + 1 x 1 = 9 GPUs", "gives 8"]),
        ((2, "colocated", 4, 1, 1), ["learner.world_size = 4", "needs 4 GPUs", "gives 2"]),
        ((4, "colocated", 2, 1, 4), ["4 GPUs per engine (engine.tp_size) > learner.world_size = 2"]),
        ((8, "colocated", 4, 3, 2), ["engine.count x GPUs per engine = 3 x 2 = 6", "learner.world_size = 4"]),
    ],
    ids=lambda v: str(v),
)
def test_a_plan_that_does_not_fit_is_refused_with_its_numbers(shape: tuple, words: list[str]) -> None:
    n, placement, ranks, engines, per_engine = shape
    with pytest.raises(ConfigError) as err:
        resolve_plan(GPUS[n], placement, ranks, engines, per_engine)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_no_gpu_runs_everything_on_the_cpu_in_both_placements() -> None:
    for placement in devices.PLACEMENTS:
        plan = resolve_plan([], placement, 2, 2, 1)
        assert not plan.on_gpu and plan.learner_env() == {"CUDA_VISIBLE_DEVICES": ""}
        assert plan.engine_env(1) == {"CUDA_VISIBLE_DEVICES": ""}
        assert plan.to_json()["device"] == "cpu"
        assert "CPU only" in plan.describe()[0]


def test_devices_setting_is_parsed_or_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_devices("cpu") == [] and parse_devices("CPU") == []
    assert parse_devices("3, 1") == ["3", "1"]  # ids as CUDA_VISIBLE_DEVICES names them, in the given order
    assert parse_devices("GPU-8f2c,GPU-91aa") == ["GPU-8f2c", "GPU-91aa"]
    assert parse_devices("auto", detect=lambda: ["0", "1"]) == ["0", "1"]
    for bad in ("", "0,,1", "0,0"):
        with pytest.raises(ConfigError, match=r"shared\.devices"):
            parse_devices(bad)
    # auto reads the GPUs this process was given (a scheduler's CUDA_VISIBLE_DEVICES) before counting any
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert devices.visible_gpus() == ["4", "5", "6"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.visible_gpus() == []


def config(tmp_path: Path, **sections: dict) -> StreamRLConfig:
    return StreamRLConfig.model_validate({"shared": {"run_dir": str(tmp_path)}, **sections})


def test_plan_for_reads_the_config_and_sglang_tp(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        shared={"run_dir": str(tmp_path), "devices": "0,1,2,3,4,5"},
        learner={"world_size": 2},
        engine={"count": 2, "kind": "sglang", "tp_size": 2},
    )
    plan = plan_for(cfg)
    assert plan.learner == ("0", "1") and plan.engines == (("2", "3"), ("4", "5"))
    builtin = config(tmp_path, shared={"run_dir": str(tmp_path), "devices": "0,1,2,3"}, engine={"tp_size": 2})
    plan = plan_for(builtin)  # the built-in engine has no TP: one GPU each, whatever tp_size says
    assert plan.gpus_per_engine == 1 and plan.engines == (("2",), ("3",))


def test_a_role_that_picks_its_own_gpu_is_refused(tmp_path: Path) -> None:
    cfg = config(
        tmp_path, shared={"run_dir": str(tmp_path), "devices": "0,1,2,3"}, engine={"device": "cuda:2"}
    )
    with pytest.raises(ConfigError, match=r"engine\.device = 'cuda:2'"):
        plan_for(cfg)


def test_child_specs_hand_each_role_its_devices(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg.rollout.engine_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    plan = resolve_plan(GPUS[4], "disaggregated", 2, 2, 1)
    before, after = child_specs(cfg, tmp_path / "config.toml", plan)
    env = {s.name: s.env.get("CUDA_VISIBLE_DEVICES") for stage in (*before, *after) for s in stage}
    assert env == {
        "redis": "", "engine-0": "2", "engine-1": "3", "archive": "", "learner": "0,1",
        "rollout-0": "", "eval": "", "dashboard": "",
    }  # fmt: skip
    # without a plan (the Ray launcher: Ray's resources place devices) no role's environment is touched
    before, after = child_specs(cfg, tmp_path / "config.toml")
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for stage in (*before, *after) for s in stage)


def test_up_refuses_a_plan_that_does_not_fit_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", "--shared.devices=0,1,2",
         "--learner.world_size=2", "--engine.count=2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "= 4 GPUs, but shared.devices gives 3 (0,1,2)" in out.stderr
    assert "preparing the warm-started tiny model" not in out.stdout  # refused before the model is built
    assert not (run_dir / "logs").exists() and not (run_dir / devices.PLAN_FILE).exists()
    assert time.monotonic() - started < 60


# One `up` per GPU count and placement, the environment of every process read back. Slow (about 40 s each on 2
# cores): the default run covers the same path end to end on 4 GPUs (tests/test_up.py's SIGTERM test).
RUNS = [
    (1, "colocated", 1, 1),
    (2, "disaggregated", 1, 1),
    (2, "colocated", 2, 2),
    (4, "disaggregated", 2, 2),
    (4, "colocated", 2, 2),
    (8, "disaggregated", 2, 2),
    (8, "colocated", 2, 2),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("gpus", "placement", "ranks", "engines"), RUNS)
def test_every_process_of_up_sees_its_planned_gpus(
    tmp_path: Path, gpus: int, placement: str, ranks: int, engines: int
) -> None:
    import signal

    from benchmarks.crash_cost import learner_step
    from streamrl.warm_start import init_warm_model
    from tests.procs import check_run_environments
    from tests.test_up import metrics_base_port, up

    run_dir = tmp_path / "run"
    proc = up(
        run_dir, init_warm_model(), metrics_base_port(), "--learner.wandb_mode=disabled",
        "--eval.heldout_prompts=20", f"--shared.devices={','.join(GPUS[gpus])}", f"--shared.placement={placement}",
        f"--learner.world_size={ranks}", f"--engine.count={engines}",
        # colocated at eta 0, its default use: at eta >= 1 the config refuses the engine's default memory fraction
        # on a shared GPU
        *(["--shared.eta=0"] if placement == "colocated" else []),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while learner_step(run_dir) < 1:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        seen = check_run_environments(run_dir, learner_ranks=ranks)
        assert {"learner", *(f"engine-{i}" for i in range(engines))} <= set(seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)


def test_colocated_on_a_ray_cluster_is_refused_by_the_config() -> None:
    from streamrl.config import load

    with pytest.raises(ConfigError, match=r"shared\.placement = 'colocated' with up\.launcher = 'ray'"):
        load(["--shared.placement=colocated", "--up.launcher=ray"])
    assert load(["--shared.placement=colocated"]).shared.placement == "colocated"


def test_colocated_transport_and_memory_release_follow_placement_and_eta() -> None:
    from streamrl.config import load

    cfg = load(["--shared.placement=colocated", "--shared.eta=0"])
    sync = cfg.weight_sync.for_placement(cfg.shared.placement, cfg.shared.eta)
    assert (sync.transport, sync.release_memory, sync.sleeps) == ("tensor", ["kv_cache"], True)
    cfg = load(["--shared.placement=colocated"])  # eta 1: engines generate while the learner trains
    sync = cfg.weight_sync.for_placement(cfg.shared.placement, cfg.shared.eta)
    assert (sync.transport, sync.release_memory, sync.sleeps) == ("tensor", [], False)
    sync = load([]).weight_sync.for_placement("disaggregated", 1)
    assert (sync.transport, sync.sleeps) == ("distributed", False)
    with pytest.raises(ConfigError, match=r"release_memory = \['kv_cache'\] with shared\.eta = 2"):
        load(["--shared.placement=colocated", "--shared.eta=2", '--weight_sync.release_memory=["kv_cache"]'])
    with pytest.raises(ConfigError, match=r"lora_sync = 'adapter' with the tensor transport"):
        load(["--shared.placement=colocated", "--learner.lora.rank=4", "--weight_sync.lora_sync=adapter"])


def test_colocated_on_gpus_refuses_nccl_and_an_engine_that_keeps_most_of_the_gpu(tmp_path: Path) -> None:
    base = {"run_dir": str(tmp_path), "devices": "0,1", "placement": "colocated"}
    with pytest.raises(ConfigError, match=r"NCCL refuses two ranks of one group on one GPU"):
        plan_for(config(tmp_path, shared=base, weight_sync={"transport": "distributed"}))
    with pytest.raises(
        ConfigError, match=r"engine\.mem_fraction_static = 0\.8 with colocated engines that keep"
    ):
        plan_for(config(tmp_path, shared={**base, "eta": 1}))
    assert plan_for(config(tmp_path, shared={**base, "eta": 1}, engine={"mem_fraction_static": 0.4})).on_gpu
    assert plan_for(config(tmp_path, shared={**base, "eta": 0})).engines == (("0",), ("1",))


def _plan_output(capsys: pytest.CaptureFixture, args: list[str]) -> tuple[int, str, str]:
    from streamrl.cli import main as cli_main

    code = cli_main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_streamrl_plan_prints_the_plan_or_refuses_it(capsys: pytest.CaptureFixture) -> None:
    # `--shared.devices=0` arrives as the integer 0: it is GPU 0, not a type error
    code, out, _ = _plan_output(
        capsys,
        [
            "--shared.devices=0",
            "--shared.placement=colocated",
            "--shared.eta=0",
            "--learner.world_size=1",
            "--engine.count=1",
        ],
    )
    assert code == 0
    assert out.splitlines()[:3] == [
        "device plan (colocated): GPUs 0",
        "  learner: GPUs 0 (rank r on the r-th)",
        "  engine-0: GPUs 0",
    ]
    assert "transport tensor; engines release kv_cache" in out
    code, out, err = _plan_output(capsys, ["--shared.devices=0,1,2", "--learner.world_size=2"])
    assert code == 2 and out == ""
    assert "= 4 GPUs, but shared.devices gives 3 (0,1,2)" in err
    code, out, _ = _plan_output(capsys, ["--up.launcher=ray", "--learner.world_size=4", "--engine.count=3"])
    assert code == 0 and "learner: 4 rank(s) x {'GPU': 1.0}" in out and "engines: 3 x {'GPU': 1.0}" in out


def test_the_readme_shows_what_streamrl_plan_prints(capsys: pytest.CaptureFixture) -> None:
    # every "$ streamrl plan ..." block of the README is that command's output, word for word
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [b.split("\n```", 1)[0] for b in readme.split("```\n$ streamrl plan ")[1:]]
    assert len(blocks) == 3  # one GPU, one node, a cluster
    for block in blocks:
        command, expected = block.split("\n", 1)
        code, out, err = _plan_output(capsys, command.split())
        assert code == 0, err
        assert out == expected + "\n", command
