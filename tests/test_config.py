"""The config tree: file + dotted overrides, errors naming field and value, cross-role rules, --help."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import Field

from broker.configlib import ConfigError, Section, iter_fields, load_config, role_main
from streamrl.cli import main
from streamrl.config import StreamRLConfig, load


def test_file_then_overrides_win(tmp_path: Path) -> None:
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('[shared]\neta = 4\nrun_id = "from-file"\n[learner]\nlr = 0.001\n')
    cfg = load(["--config", str(cfg_file), "--shared.eta=1", "--learner.groups_per_step", "4"])
    assert cfg.shared.eta == 1
    assert cfg.shared.run_id == "from-file"
    assert cfg.learner.lr == 0.001
    assert cfg.learner.groups_per_step == 4


def test_error_names_field_and_value() -> None:
    with pytest.raises(ConfigError) as info:
        load(["--learner.lr=abc"])
    assert "learner.lr" in str(info.value) and "'abc'" in str(info.value)


def test_unknown_field_is_an_error() -> None:
    with pytest.raises(ConfigError, match="learner.lrr"):
        load(["--learner.lrr=1"])


def test_redis_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    assert load([]).shared.redis_url == "redis://example:6379/0"
    assert load(["--shared.redis_url=redis://other:1/0"]).shared.redis_url == "redis://other:1/0"


def test_backlog_rule_spans_roles() -> None:
    with pytest.raises(ConfigError, match="max_backlog"):
        load(["--learner.groups_per_step=64", "--broker.max_backlog=100"])
    ok = load(["--learner.groups_per_step=64", "--broker.max_backlog=512"])
    assert ok.broker.max_backlog == 512


def test_claim_idle_rule_spans_roles() -> None:
    with pytest.raises(ConfigError, match="claim_idle_ms"):
        load(["--learner.checkpoint_interval_s=100", "--broker.claim_idle_ms=150000"])


def test_every_field_has_a_doc() -> None:
    missing = [name for name, _, _, doc in iter_fields(StreamRLConfig) if not doc.strip()]
    assert missing == []


def test_help_lists_every_field_of_the_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["learner", "--help"]) == 0
    out = capsys.readouterr().out
    for name, _, _, doc in iter_fields(StreamRLConfig):
        if name.split(".")[0] in ("shared", "broker", "learner", "weight_sync"):
            assert f"--{name} " in out and doc in out
    assert "--dashboard.port" not in out


def test_resolved_config_written_to_run_dir(tmp_path: Path) -> None:
    code = main(["redis", f"--shared.run_dir={tmp_path}", "--shared.redis_url=redis://127.0.0.1:1/0"])
    assert code == 0
    written = tomllib.loads((tmp_path / "config.redis.toml").read_text())
    assert written["shared"]["redis_url"] == "redis://127.0.0.1:1/0"
    assert StreamRLConfig.model_validate(written).shared.run_dir == tmp_path


def test_console_script_reports_bad_value() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "learner", "--shared.eta=-3"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "shared.eta = -3" in proc.stderr


def test_model_init_builds_a_hugging_face_directory(tmp_path: Path) -> None:
    assert main(["model", "init", "--out", str(tmp_path / "m"), "--steps", "2"]) == 0
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()
    assert (tmp_path / "m" / "warmstart.json").is_file()
    assert main(["model", "nonsense"]) == 2


class _Inner(Section):
    size: int = Field(3, ge=1, description="How many widgets the toy role makes.")
    name: str = Field("w", description="What the toy role calls them.")


class _ToyRoleConfig(Section):
    toy: _Inner = Field(default_factory=_Inner, description="A toy role.")


def _toy_main(argv: list[str], seen: list[_ToyRoleConfig], **kwargs: object) -> int:
    def run(cfg: _ToyRoleConfig) -> int:
        seen.append(cfg)
        return 7

    return role_main("toy", _ToyRoleConfig, argv, run, **kwargs)  # type: ignore[arg-type]


def test_role_main_help_prints_field_docs_without_running(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[_ToyRoleConfig] = []
    base_calls: list[int] = []
    for flag in ("--help", "-h"):
        code = _toy_main([flag, "--toy.size=abc"], seen, base=lambda: base_calls.append(1) or None)
        assert code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m toy [--config FILE] [--section.field=value ...]\n")
        assert "--toy.size int (default: 3)" in out and "How many widgets the toy role makes." in out
    assert seen == [] and base_calls == []  # --help neither runs the role nor reads its base


def test_role_main_bad_value_exits_2_naming_field_and_value(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[_ToyRoleConfig] = []
    assert _toy_main(["--toy.size=abc"], seen, error_prefix="toy: ") == 2
    err = capsys.readouterr().err
    assert err.startswith("toy: invalid configuration:") and "toy.size = 'abc'" in err
    assert _toy_main(["--toy.size=0"], seen) == 2
    assert "toy.size = 0" in capsys.readouterr().err
    assert _toy_main(["--toy.sise=4"], seen) == 2
    assert "toy.sise" in capsys.readouterr().err
    assert seen == []


def test_role_main_runs_with_the_validated_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[_ToyRoleConfig] = []
    cfg_file = tmp_path / "toy.toml"
    cfg_file.write_text('[toy]\nsize = 5\nname = "file"\n')
    base = {"toy": {"size": 2, "name": "base"}}
    args = ["--config", str(cfg_file), "--toy.size", "9"]
    assert _toy_main(args, seen, base=lambda: base) == 7  # run's exit code is main's
    assert [(c.toy.size, c.toy.name) for c in seen] == [(9, "file")]  # base < file < overrides, as ints

    def failing(cfg: _ToyRoleConfig) -> int:
        raise ConfigError(f"toy.name = {cfg.toy.name!r}: not a widget")

    assert role_main("toy", _ToyRoleConfig, ["--toy.name=x"], failing, error_prefix="toy: ") == 2
    assert capsys.readouterr().err == "toy: toy.name = 'x': not a widget\n"


@pytest.mark.parametrize(
    ("module", "prog", "section"),
    [
        ("broker.main", "broker", "redis"),
        ("rollout_fleet.engine.main", "rollout_fleet.engine", "engine"),
        ("rollout_fleet.main", "rollout_fleet", "rollout"),
        ("learner.main", "learner", "learner"),
        ("streamrl.dashboard", "streamrl.dashboard", "dashboard"),
    ],
)
def test_every_role_main_shares_help_and_errors(
    module: str, prog: str, section: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main_of_role = importlib.import_module(module).main
    assert main_of_role(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {prog} [--config FILE]") and f"\n[{section}]" in out
    assert main_of_role(["--shared.eta=abc"]) == 2
    err = capsys.readouterr().err
    assert "shared.eta = 'abc'" in err and err.startswith("learner: " if prog == "learner" else "invalid")


def test_cpu_affinity_pins_the_process_and_names_a_missing_core() -> None:
    import os

    from broker.configlib import ConfigError
    from broker.cpus import pin_to_cpus

    code = "import os; from broker.cpus import pin_to_cpus; pin_to_cpus([0], 'x'); print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[0]"
    before = os.sched_getaffinity(0)
    with pytest.raises(ConfigError, match=r"learner.cpu_affinity = \[4096\].*4096"):
        pin_to_cpus([4096], "learner.cpu_affinity")
    pin_to_cpus([], "engine.cpu_affinity")
    assert os.sched_getaffinity(0) == before


def test_engine_refuses_a_core_it_does_not_have(tmp_path) -> None:
    args = [
        sys.executable,
        "-m",
        "streamrl",
        "engine",
        "--engine.cpu_affinity=[4096]",
        f"--shared.model_path={tmp_path}",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "engine.cpu_affinity = [4096]" in proc.stderr + proc.stdout


def test_learner_rejects_a_kl_term_it_has_no_reference_model_for() -> None:
    with pytest.raises(ConfigError, match=r"kl_coef = 0.1"):
        load_config(StreamRLConfig, ["--learner.loss.kl_coef=0.1"])
    assert load_config(StreamRLConfig, ["--learner.loss.kl_coef=0"]).learner.loss.kl_coef == 0
