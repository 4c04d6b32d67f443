"""The config tree: file + dotted overrides, errors naming field and value, cross-role rules, --help."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from broker.configlib import ConfigError, iter_fields
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
