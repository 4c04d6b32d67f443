"""``streamrl compose --devices N``: a docker-compose file for one GPU node, written from the device plan.

The same plan ``up`` resolves (streamrl.devices) decides which GPUs each container reserves: the learner's
``learner.world_size`` GPUs (one torchrun rank each) and each SGLang engine's TP group. The SGLang command line is
rollout_fleet.fleet's (one home); every streamrl service runs a real sub-command whose options validate. The
repository's docker-compose.yml is this command's output (tests/test_compose.py keeps them equal).

    streamrl compose --devices 4 --out docker-compose.yml [--section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common.configlib import ConfigError
from rollout_fleet.fleet import sglang_server_args
from streamrl.config import StreamRLConfig, load
from streamrl.devices import DevicePlan, plan_for

SGLANG_PORT = 30000
HEADER = """\
# streamrl on one GPU node, written by `{command}` from the device plan (streamrl.devices):
{plan}
# Edit the command's options, not this file: `tests/test_compose.py` checks the file is its output.
# `cp .env.example .env`, edit it, build the image (`docker compose build`), then `docker compose up`.
"""


def _gpus(ids: tuple[str, ...]) -> dict[str, Any]:
    return {"resources": {"reservations": {"devices": [
        {"driver": "nvidia", "device_ids": list(ids), "capabilities": ["gpu"]}
    ]}}}  # fmt: skip


def _streamrl(command: list[str], **extra: Any) -> dict[str, Any]:
    """A service of the streamrl image running ``command``, with the run's Redis and volumes."""
    return {
        "image": "${STREAMRL_IMAGE:-streamrl:latest}",
        "build": {
            "context": ".",
            "dockerfile": "docker/Dockerfile",
            "args": {"SGLANG_IMAGE": "${SGLANG_IMAGE:-lmsysorg/sglang:v0.5.23}"},
        },
        "ipc": "host",
        "volumes": ["${MODEL_DIR}:/model:ro", "runs:/runs"],
        "environment": {"REDIS_URL": "redis://:${REDIS_PASSWORD}@redis:6379/0", "WANDB_MODE": "offline"},
        "command": command,
        "depends_on": {"redis": {"condition": "service_healthy"}},
        "stop_grace_period": "60s",
        **extra,
    }


def services(cfg: StreamRLConfig, plan: DevicePlan) -> dict[str, Any]:
    """Every service of the node: Redis, one SGLang server per engine, the learner (torchrun), a rollout worker,
    the archiver, the evaluator and the dashboard."""
    engine = cfg.engine.model_copy(update={"kind": "sglang"})
    names = [f"sglang-{i}" for i in range(len(plan.engines))]
    urls = json.dumps([f"http://{n}:{SGLANG_PORT}" for n in names])
    run = ["--shared.run_id=${RUN_ID}", "--shared.run_dir=/runs/${RUN_ID}"]
    model = ["--shared.model_path=/model"]
    eta = [f"--shared.eta={cfg.shared.eta}"]
    engines_ready = {n: {"condition": "service_healthy"} for n in names}
    out: dict[str, Any] = {
        "redis": {
            "image": "redis:7",
            "command": ["redis-server", "--appendonly", "yes", "--appendfsync", "everysec", "--requirepass",
                        "${REDIS_PASSWORD}", "--maxmemory", "8gb", "--maxmemory-policy", "noeviction"],
            "volumes": ["redis-data:/data"],
            "healthcheck": {"test": ["CMD-SHELL", 'redis-cli -a "$$REDIS_PASSWORD" ping | grep PONG'],
                            "interval": "5s", "retries": 20},
            "environment": {"REDIS_PASSWORD": "${REDIS_PASSWORD}"},
        },
    }  # fmt: skip
    for i, name in enumerate(names):
        seeded = engine.model_copy(update={"seed": engine.seed_of(i)})
        out[name] = {
            "image": "${SGLANG_IMAGE:-lmsysorg/sglang:v0.5.23}",
            "ipc": "host",
            "volumes": ["${MODEL_DIR}:/model:ro"],
            "command": ["python3", "-m", "sglang.launch_server",
                        *sglang_server_args(seeded, "/model", "0.0.0.0", SGLANG_PORT)],
            "deploy": _gpus(plan.engines[i]),
            "healthcheck": {"test": ["CMD", "curl", "-f", f"http://localhost:{SGLANG_PORT}/health"],
                            "interval": "10s", "start_period": "300s", "retries": 30},
            "stop_grace_period": "30s",
        }  # fmt: skip
    learner = ["torchrun", "--standalone", f"--nproc_per_node={len(plan.learner)}", "-m", "streamrl", "learner",
               *run, *model, *eta, f"--learner.world_size={len(plan.learner)}",
               f"--weight_sync.engine_urls={urls}", "--weight_sync.master_address=learner",
               "--weight_sync.backend=nccl"]  # fmt: skip
    out["learner"] = _streamrl(
        learner, hostname="learner", deploy=_gpus(plan.learner),
        depends_on={"redis": {"condition": "service_healthy"}, **engines_ready},
    )  # fmt: skip
    out["rollout"] = _streamrl(
        ["python3", "-m", "streamrl", "rollout", *run, *model, *eta, f"--rollout.engine_urls={urls}"],
        depends_on={"redis": {"condition": "service_healthy"}, **engines_ready},
    )
    out["archive"] = _streamrl(["python3", "-m", "streamrl", "archive", *run, *model])
    out["eval"] = _streamrl(
        ["python3", "-m", "streamrl", "eval", *run, *model, f"--rollout.engine_urls={urls}"]
    )
    out["dashboard"] = _streamrl(
        ["python3", "-m", "streamrl", "dashboard", *run, "--dashboard.host=0.0.0.0", "--dashboard.port=8265",
         f"--dashboard.engine_urls={urls}"],
        ports=["127.0.0.1:${DASHBOARD_PORT:-8265}:8265"],
    )  # fmt: skip
    return out


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(str(value))  # a JSON string is a YAML double-quoted scalar


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists and scalars; lists of scalars in flow style (compose's commands)."""
    pad = "  " * indent
    lines = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item and not _flat(item):
                lines.append(f"{pad}{key}:")
                lines.append(to_yaml(item, indent + 1))
            else:
                lines.append(f"{pad}{key}: {_inline(item)}")
    else:
        for item in value:
            if isinstance(item, dict):
                body = to_yaml(item, indent + 1).lstrip()
                lines.append(f"{pad}- {body}")
            else:
                lines.append(f"{pad}- {_inline(item)}")
    return "\n".join(lines)


def _flat(value: Any) -> bool:
    return isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value)


def _inline(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_inline(v)}" for k, v in value.items()) + "}"
    return _scalar(value)


def check_composable(cfg: StreamRLConfig) -> None:
    """A compose file gives each engine and the learner containers of their own GPUs: refuse anything else
    before the plan's own checks, so the refusal names the placement (the real reason)."""
    if cfg.shared.placement != "disaggregated":
        raise ConfigError(
            f"shared.placement = {cfg.shared.placement!r}: a compose file runs each engine and the learner in "
            "containers of their own GPUs (disaggregated, on a GPU node); for colocated run "
            "`streamrl up --shared.placement=colocated` in one container"
        )


def render(cfg: StreamRLConfig, plan: DevicePlan, command: str) -> str:
    """The whole compose file: a header with the plan, the services, the volumes."""
    check_composable(cfg)
    if not plan.on_gpu:
        raise ConfigError("a compose file is for a node with GPUs: the device plan has none")
    plan_lines = "\n".join(f"#   {line}" for line in plan.describe())
    doc = {"name": "streamrl", "services": services(cfg, plan), "volumes": {"redis-data": None, "runs": None}}
    body = to_yaml(doc).replace(": null", ":")
    return HEADER.format(command=command, plan=plan_lines) + body + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="streamrl compose",
        description="Write a docker-compose file for one GPU node from the device plan: the learner's GPUs "
        "(learner.world_size), each SGLang engine's TP group (engine.count x engine.tp_size). Other options are "
        "config overrides (--section.field=value), as for every role.",
    )
    parser.add_argument("--devices", type=int, required=True, help="GPUs of the node (ids 0..N-1).")
    parser.add_argument("--out", type=Path, default=None, help="File to write (default: standard output).")
    args, overrides = parser.parse_known_args(argv)
    if args.devices < 1:
        parser.error(f"--devices = {args.devices}: a compose file is for a node with GPUs (1 or more)")
    ids = ",".join(str(i) for i in range(args.devices))
    command = " ".join(["streamrl compose", f"--devices {args.devices}", *overrides])
    try:
        cfg = load([*overrides, f"--shared.devices={ids}", "--engine.kind=sglang"])
        check_composable(cfg)
        text = render(cfg, plan_for(cfg), command)
    except ConfigError as exc:
        print(f"streamrl compose: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"streamrl compose: wrote {args.out}", file=sys.stderr)
    return 0
