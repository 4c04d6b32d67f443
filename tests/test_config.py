"""The config tree: file + dotted overrides, errors naming field and value, cross-role rules, --help."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from pydantic import Discriminator, Field, Tag

from common.configlib import (
    REQUIRED,
    ConfigError,
    Section,
    dump_config,
    iter_fields,
    load_config,
    render_help,
)
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


ROLES = ("redis", "engine", "rollout", "learner", "eval", "dashboard")


@pytest.mark.parametrize("role", ROLES)
def test_every_role_has_one_entry_path_with_the_roots_validation(
    role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`streamrl ROLE` is the only way to start a role: its --help lists what it reads, a bad value is refused
    naming the field and the value, and the rules that span roles are checked for every role."""
    from streamrl.cli import COMMANDS, main

    assert main([role, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: streamrl {role} [--config FILE.toml]")
    for section in COMMANDS[role].sections:
        assert f"\n[{section}]" in out
    for field in COMMANDS[role].fields:
        assert f"--{field} " in out  # the single fields it reads from other sections
    assert main([role, "--shared.eta=abc"]) == 2
    assert "shared.eta = 'abc'" in capsys.readouterr().err
    # a rule that spans roles (the back-pressure bound) is refused by the rollout worker and the redis server
    # alike, not only by `streamrl up`
    assert main([role, "--broker.max_backlog=1"]) == 2
    assert "broker.max_backlog = 1" in capsys.readouterr().err


def test_rollout_help_lists_the_learner_and_metrics_fields_it_reads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from streamrl.cli import main

    assert main(["rollout", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--learner.groups_per_step int" in out and "--dashboard.metrics_base_port int" in out
    assert "--learner.lr " not in out  # the rest of the learner section is not the worker's


def test_redis_help_lists_the_ports_it_reads_from_other_sections(capsys: pytest.CaptureFixture[str]) -> None:
    """`streamrl redis` reads its Prometheus port and the ports promised to the engines, the sglang router and
    the dashboard (it must not draw one of them): --help shows those fields, and no other of their sections."""
    from streamrl.cli import main

    assert main(["redis", "--help"]) == 0
    out = capsys.readouterr().out
    for field in (
        "dashboard.metrics_base_port",
        "rollout.engine_urls",
        "rollout.sglang_router_port",
        "dashboard.port",
    ):
        assert f"--{field} " in out
    assert "--rollout.group_size " not in out and "--dashboard.refresh_s " not in out
    # its metrics are served on redis.host, so dashboard.metrics_host is not one of its fields
    assert "--dashboard.metrics_host " not in out


def test_cpu_affinity_pins_the_process_and_names_a_missing_core() -> None:
    import os

    from common.configlib import ConfigError
    from common.cpus import pin_to_cpus

    code = "import os; from common.cpus import pin_to_cpus; pin_to_cpus([0], 'x'); print(sorted(os.sched_getaffinity(0)))"
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
        f"--shared.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "engine.cpu_affinity = [4096]" in proc.stderr + proc.stdout


def test_reference_kl_options_are_checked_by_name() -> None:
    cfg = load_config(StreamRLConfig, ["--learner.loss.kl_coef=0.1", "--learner.loss.kl_estimator=k2"])
    assert cfg.learner.loss.kl_coef == 0.1 and cfg.learner.loss.kl_estimator == "k2"
    with pytest.raises(ConfigError, match=r"kl_estimator"):
        load_config(StreamRLConfig, ["--learner.loss.kl_estimator=k4"])
    with pytest.raises(ConfigError, match=r"kl_mode"):
        load_config(StreamRLConfig, ["--learner.loss.kl_mode=advantage"])


def test_lora_through_sglang_adapter_paths_needs_a_directory() -> None:
    args = ["--learner.lora.rank=8", "--weight_sync.lora_sync=adapter_path"]
    with pytest.raises(ConfigError, match=r"weight_sync.adapter_dir"):
        load_config(StreamRLConfig, args)
    cfg = load_config(StreamRLConfig, [*args, "--weight_sync.adapter_dir=/tmp/adapters"])
    assert cfg.weight_sync.adapter_dir == "/tmp/adapters"
    assert cfg.served_adapter_name()(7) == "policy-v7"  # what rollout requests carry as lora_path
    with pytest.raises(ConfigError, match=r"weight_sync.keep_adapters = 1"):
        load_config(StreamRLConfig, [*args, "--weight_sync.adapter_dir=/a", "--weight_sync.keep_adapters=1"])
    no_lora = load_config(StreamRLConfig, ["--weight_sync.lora_sync=adapter_path"])
    assert no_lora.learner.lora.rank == 0 and no_lora.served_adapter_name() is None


def test_redis_is_told_the_ports_up_promised_the_other_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` draws the engines' and the dashboard's ports before Redis starts; the `redis` role must pass them on
    (a `make run` failed when Redis drew an engine's port: tests/test_redis_server.py shows they are avoided)."""
    import broker.main
    from streamrl import cli
    from streamrl.up import promised_ports, resolve

    cfg = StreamRLConfig.model_validate(
        {"shared": {"run_dir": str(tmp_path), "model_path": str(tmp_path)}, "dashboard": {"port": 0}}
    )
    cfg = resolve(cfg)
    engine_ports = {int(url.rsplit(":", 1)[1]) for url in cfg.rollout.engine_urls}
    assert len(engine_ports) == cfg.engine.count
    assert promised_ports(cfg) == engine_ports | {cfg.dashboard.port}
    passed = {}
    monkeypatch.setattr(broker.main, "run_redis", lambda *args: passed.setdefault("avoid", args[3]) and 0)
    cli._run_redis(cfg)
    assert passed["avoid"] == promised_ports(cfg)


# every built-in task with options other than its defaults, as a user writes them on the command line
TASK_FLAGS = {
    "arithmetic": ["--rollout.task.seed=3", "--rollout.task.format_weight=0.1"],
    "long_multiplication": [
        "--rollout.task.min_digits=2",
        "--rollout.task.max_digits=5",
        "--rollout.task.step_weight=0",
    ],
    "gsm8k": [
        "--rollout.task.dataset=d.jsonl",
        "--rollout.task.instruction=",
        "--rollout.task.chat_template=always",
    ],
    "countdown": ["--rollout.task.use_all=true", "--rollout.task.max_target=50", "--rollout.task.seed=1"],
    "dataset": ["--rollout.task.dataset=d.jsonl", "--rollout.task.prompt_field=q.text"],
    "tool_arithmetic": ["--rollout.task.heldout_size=20"],
    "openenv": ["--rollout.task.env_url=http://127.0.0.1:1", "--rollout.task.env_timeout_s=2"],
    "verifiers": ["--rollout.task.verifiers_taskset=t", '--rollout.task.verifiers_config={"a": {"b": 1}}'],
    "tests.agentic_tasks:EchoTask": ["--rollout.task.observations=3"],
}


@pytest.mark.parametrize("name", sorted(TASK_FLAGS))
def test_every_task_config_round_trips_through_the_run_directory(tmp_path: Path, name: str) -> None:
    """`up` writes the resolved config (dump_config) and every role reads it back with --config."""
    cfg = load([f"--rollout.task.name={name}", *TASK_FLAGS[name]])
    dump_config(cfg, tmp_path / "config.toml")
    again = load(["--config", str(tmp_path / "config.toml")])
    assert type(again.rollout.task) is type(cfg.rollout.task) and again.rollout.task == cfg.rollout.task
    assert again.rollout.task.options() == cfg.rollout.task.options() != {}


def test_the_task_name_selects_the_class_and_its_fields(tmp_path: Path) -> None:
    cfg = load(["--rollout.task.name=long_multiplication", "--rollout.task.min_digits=2"])
    assert type(cfg.rollout.task).__name__ == "LongMultiplicationConfig"
    assert (cfg.rollout.task.min_digits, cfg.rollout.task.max_digits, cfg.rollout.task.step_weight) == (
        2,
        27,
        0.5,
    )
    assert type(load([]).rollout.task).__name__ == "ArithmeticConfig"
    # a config file written for today's tasks: the same keys under [rollout.task]
    path = tmp_path / "run.toml"
    path.write_text('[rollout.task]\nname = "countdown"\nuse_all = true\nseed = 4\nformat_weight = 0.5\n')
    task = load(["--config", str(path)]).rollout.task
    assert (task.name, task.use_all, task.seed, task.format_weight, task.max_number) == (
        "countdown",
        True,
        4,
        0.5,
        99,
    )


def test_a_field_of_another_task_is_refused_naming_the_field_and_the_task(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="step_weight: not a field of task arithmetic"):
        load(["--rollout.task.step_weight=0.5"])  # the default task
    path = tmp_path / "run.toml"
    path.write_text('[rollout.task]\nname = "dataset"\nseed = 1\n')  # dataset prompts are not generated
    with pytest.raises(ConfigError, match=r"seed: not a field of task dataset \(its fields: .*prompt_field"):
        load(["--config", str(path)])
    with pytest.raises(
        ConfigError, match="rollout.task.long_multiplication.*min_digits = 5 is above max_digits = 4"
    ):
        load(
            [
                "--rollout.task.name=long_multiplication",
                "--rollout.task.min_digits=5",
                "--rollout.task.max_digits=4",
            ]
        )
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        load(["--rollout.task.name=nope"])
    with pytest.raises(ConfigError, match="env_url"):
        load(["--rollout.task.name=openenv"])  # required: checked when the config is read, not at build


def test_help_groups_each_tasks_fields_under_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout", "--help"]) == 0
    out = capsys.readouterr().out
    names = "arithmetic,long_multiplication,gsm8k,countdown,dataset,tool_arithmetic,openenv,verifiers"
    assert f"--rollout.task.name {{{names},package.module:Class}} (default: 'arithmetic')" in out
    groups: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("  rollout.task.name = "):
            group = groups.setdefault(line.split(" = ", 1)[1].split(":", 1)[0], [])
        elif line.startswith("    --rollout.task."):
            group.append(line.split()[0].removeprefix("--rollout.task."))
    assert groups["long_multiplication"] == [
        "seed", "train_size", "heldout_size", "format_weight", "min_digits", "max_digits", "step_weight",
    ]  # fmt: skip
    assert "use_all" in groups["countdown"] and "use_all" not in groups["arithmetic"]
    assert groups["openenv"][0] == "env_url" and "--rollout.task.env_url str (default: required)" in out
    assert set(groups) == {*names.split(","), "package.module"}


class _Adder(Section):
    """add: sums two numbers."""

    name: Literal["add"] = Field("add", description="The part.")
    left: int = Field(1, description="Left operand.")


class _Echo(Section):
    """echo: says it back."""

    name: Literal["echo"] = Field("echo", description="The part.")
    text: str = Field(description="What to say.")


def _part_name(value: Any) -> str:
    return value.get("name", "add") if isinstance(value, dict) else value.name


class _Section(Section):
    part: Annotated[
        Annotated[_Adder, Tag("add")] | Annotated[_Echo, Tag("echo")], Discriminator(_part_name)
    ] = Field(default_factory=_Adder, description="The part.")


class _Tree(Section):
    sec: _Section = Field(default_factory=_Section, description="A section.")


def test_configlib_lists_a_union_once_per_member_and_groups_its_help() -> None:
    assert list(iter_fields(_Tree)) == [
        (
            "sec.part.name",
            "{add,echo}",
            "add",
            "Selects the part; each one's fields are listed under its name.",
        ),
        ("sec.part.left", "int", 1, "Left operand."),
        ("sec.part.text", "str", REQUIRED, "What to say."),
    ]
    assert render_help(_Tree).splitlines() == [
        "[sec]  A section.",
        "  --sec.part.name {add,echo} (default: 'add')",
        "      Selects the part; each one's fields are listed under its name.",
        "  sec.part.name = add: sums two numbers.",
        "    --sec.part.left int (default: 1)",
        "        Left operand.",
        "  sec.part.name = echo: says it back.",
        "    --sec.part.text str (default: required)",
        "        What to say.",
    ]
    assert load_config(_Tree, ["--sec.part.name=echo", "--sec.part.text=hi"]).sec.part == _Echo(text="hi")
