"""docker-compose.yml: every streamrl service runs a real `streamrl` sub-command with options that exist and
validate, and ports and URLs agree across services (no Docker engine is needed to check that)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from common.configlib import iter_fields
from streamrl.cli import COMMANDS
from streamrl.config import StreamRLConfig, load

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {name for name, *_ in iter_fields(StreamRLConfig)}


def env_values() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def substitute(text: str, env: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name, _, default = m.group(1).partition(":-")
        assert name in env or default, f"${{{name}}} has no value in .env.example and no default"
        return env.get(name, default)

    return re.sub(r"\$\{([^}]+)\}", one, text.replace("$$", "\0")).replace("\0", "$")


def compose() -> dict:
    return yaml.safe_load(substitute((ROOT / "docker-compose.yml").read_text(), env_values()))


def streamrl_call(command: list[str]) -> tuple[str, list[str]] | None:
    """(sub-command, options) of a `... -m streamrl SUB --opts` or `streamrl SUB --opts` command."""
    for i, word in enumerate(command):
        if word == "streamrl" and (i == 0 or command[i - 1] == "-m"):
            return command[i + 1], command[i + 2 :]
    return None


def test_every_streamrl_service_runs_a_real_subcommand_with_valid_options() -> None:
    services = compose()["services"]
    calls = {name: streamrl_call(svc["command"]) for name, svc in services.items() if "command" in svc}
    streamrl_services = {name: call for name, call in calls.items() if call is not None}
    assert set(streamrl_services) == {"learner", "rollout", "eval", "archive", "dashboard"}
    for name, (sub, options) in streamrl_services.items():
        assert sub in COMMANDS, f"{name}: unknown sub-command {sub!r}"
        for option in options:
            key = option[2:].split("=", 1)[0]
            assert key in FIELDS, f"{name}: option --{key} does not exist"
            assert key.split(".")[0] in COMMANDS[sub].sections, f"{name}: {sub} does not read --{key}"
        load(options)  # every value validates (raises ConfigError naming the field otherwise)


def _urls(options: list[str], key: str) -> list[str]:
    for option in options:
        if option.startswith(f"--{key}="):
            return yaml.safe_load(option.split("=", 1)[1])
    return []


def test_ports_and_urls_agree_across_services() -> None:
    doc = compose()
    services = doc["services"]
    sglang_ports = {}
    for name, svc in services.items():
        if "sglang.launch_server" in svc.get("command", []):
            cmd = svc["command"]
            sglang_ports[name] = int(cmd[cmd.index("--port") + 1])
            assert svc["ipc"] == "host"
            assert "/health" in " ".join(svc["healthcheck"]["test"])
            assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert len(sglang_ports) >= 2
    expected = sorted(f"http://{name}:{port}" for name, port in sglang_ports.items())
    for name, key in (("learner", "weight_sync.engine_urls"), ("rollout", "rollout.engine_urls"),
                      ("eval", "rollout.engine_urls"), ("dashboard", "dashboard.engine_urls")):  # fmt: skip
        _, options = streamrl_call(services[name]["command"])
        assert sorted(_urls(options, key)) == expected, name
    _, learner_opts = streamrl_call(services["learner"]["command"])
    assert f"--weight_sync.master_address={services['learner']['hostname']}" in learner_opts
    password = env_values()["REDIS_PASSWORD"]
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1] == password
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    for name in ("learner", "rollout", "eval", "dashboard"):
        url = urlsplit(services[name]["environment"]["REDIS_URL"])
        assert (url.hostname, url.port or 6379, url.password) == ("redis", 6379, password), name
    _, dash_opts = streamrl_call(services["dashboard"]["command"])
    port = next(o.split("=", 1)[1] for o in dash_opts if o.startswith("--dashboard.port="))
    assert services["dashboard"]["ports"][0].rsplit(":", 1)[1] == port
    assert services["dashboard"]["ports"][0].startswith("127.0.0.1:")  # published on loopback only


def compose_output(*args: str) -> str:
    """What `streamrl compose ARGS` prints."""
    from streamrl.compose import main as compose_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert compose_main(list(args)) == 0
    return buf.getvalue()


def generated(*args: str) -> dict:
    return yaml.safe_load(substitute(compose_output(*args), env_values()))


def test_the_compose_file_is_what_the_device_plan_writes() -> None:
    """docker-compose.yml is `streamrl compose`'s output for the command its header names: edited by hand, it
    would drift from the plan that `up` uses."""
    text = (ROOT / "docker-compose.yml").read_text()
    command = re.search(r"written by `streamrl compose ([^`]*)`", text).group(1).split()
    assert compose_output(*command) == text, (
        "regenerate: python -m streamrl compose --devices N --out docker-compose.yml"
    )


def test_eight_gpus_with_tensor_parallel_engines_reserve_the_plans_devices() -> None:
    doc = generated("--devices", "8", "--learner.world_size=4", "--engine.tp_size=2")
    services = doc["services"]
    reserved = {
        name: svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for name, svc in services.items()
        if "deploy" in svc
    }
    assert reserved == {"learner": ["0", "1", "2", "3"], "sglang-0": ["4", "5"], "sglang-1": ["6", "7"]}
    for name in ("sglang-0", "sglang-1"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--base-gpu-id") + 1] == "0"
    learner = services["learner"]["command"]
    assert "--nproc_per_node=4" in learner and "--learner.world_size=4" in learner
    _, options = streamrl_call(learner)
    load(options)


def test_a_node_too_small_for_the_plan_is_refused_by_name(capsys) -> None:
    from streamrl.compose import main as compose_main

    assert compose_main(["--devices", "3"]) == 2
    assert "= 4 GPUs, but shared.devices gives 3" in capsys.readouterr().err
    assert compose_main(["--devices", "4", "--shared.placement=colocated"]) == 2
    assert "shared.placement = 'colocated'" in capsys.readouterr().err
