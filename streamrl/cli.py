"""The ``streamrl`` command line: one sub-command per role, plus ``up`` that supervises all of them."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.configlib import ConfigError, dump_config, render_help
from streamrl.config import StreamRLConfig, load

USAGE = """usage: streamrl COMMAND [--config FILE.toml] [--section.field=value ...]

Asynchronous streaming RL: SGLang (or built-in) engines -> Redis Stream -> FSDP2 learner -> weight sync.

commands:
{commands}

  model init  build (or find cached) the warm-started tiny model: `streamrl model init --help`;
              with --shape qwen2.5-0.5b, a model of that architecture with random weights and a BPE tokenizer
  audit RUN_DIR  account for every prompt group of a run: generated, trained, dropped, lost
  export RUN_DIR [--step N]  write a Hugging Face directory of the policy at a checkpoint, offline
  replay RUN_DIR [--until N]  re-run the learner on the archived batches; compare with the run's checkpoints
  compose --devices N  write a docker-compose file for one GPU node from the device plan
  inspect RUN_DIR  the run's trajectory archive: rewards by step, staleness, best / worst / random samples
  eval --adversarial  score every built-in verifier's adversarial set (each case must score 0; exit 1 if not)

`streamrl COMMAND --help` lists every config field the command reads, with its type, default and doc.
Values come from the defaults, then REDIS_URL, then --config, then the dotted overrides. Every role starts here
(also as `python -m streamrl COMMAND`), so every role runs the same validation, the rules that span roles
included."""


@dataclass(frozen=True)
class Command:
    summary: str
    sections: tuple[str, ...]  # whole sections the command reads
    run: Callable[[StreamRLConfig], int]
    fields: tuple[str, ...] = ()  # single fields it reads from other sections (shown by --help too)


# Every role with a Prometheus endpoint of its own port reads where to serve it.
METRICS_FIELDS = ("dashboard.metrics_host", "dashboard.metrics_base_port")
# The ports streamrl.up.promised_ports gives the run's servers: `streamrl redis` starts first and avoids them.
PROMISED_PORT_FIELDS = ("rollout.engine_urls", "rollout.sglang_router_port", "dashboard.port")
# What `up` and `plan` read: every section but streamrl sft's, which is a run of its own.
RUN_SECTIONS = tuple(name for name in StreamRLConfig.model_fields if name != "sft")
LORA_NAMING_FIELDS = ("learner.lora.rank", "weight_sync.lora_sync", "weight_sync.lora_name")


def _with_prometheus(config: StreamRLConfig, role: str, index: int, run: Callable[[], int]) -> int:
    """Run a role with its Prometheus endpoint (dashboard.metrics_port) up for its whole life."""
    from streamrl.dashboard import serve_role_metrics

    server = serve_role_metrics(config, role, index)
    try:
        return run()
    finally:
        if server is not None:
            server.stop()


def _worker_index(worker_id: str | None) -> int:
    """The trailing number of a worker id ("worker-3" -> 3), which picks its Prometheus port; else 0."""
    match = re.search(r"(\d+)$", worker_id or "")
    return int(match.group(1)) if match else 0


def _run_redis(config: StreamRLConfig) -> int:
    from broker.main import run_redis
    from streamrl.up import promised_ports

    return run_redis(
        config.shared, config.redis, config.dashboard.metrics_port("redis"), promised_ports(config)
    )


def _run_engine(config: StreamRLConfig) -> int:
    from rollout_fleet.engine.main import run_engine

    return run_engine(config.shared, config.engine)  # the engine serves /metrics on its own HTTP port


def _run_learner(config: StreamRLConfig) -> int:
    from learner.main import LearnerSections, run_learner

    role = LearnerSections(config.shared, config.broker, config.learner, config.weight_sync)
    # Each rank runs this same entry path with the resolved config main() wrote, and its RANK set.
    ranks = [
        sys.executable,
        "-m",
        "streamrl",
        "learner",
        "--config",
        str(resolved_config_path(config, "learner")),
    ]
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 serves the learner's metrics
        return run_learner(role, ranks)
    return _with_prometheus(config, "learner", 0, lambda: run_learner(role, ranks))


def _run_sft(config: StreamRLConfig) -> int:
    from learner.sft import run_sft

    # Each rank runs this same entry path with the resolved config main() wrote, and its RANK set.
    ranks = [sys.executable, "-m", "streamrl", "sft", "--config", str(resolved_config_path(config, "sft"))]
    return run_sft(config.shared, config.sft, ranks)


def _run_rollout(config: StreamRLConfig) -> int:
    from rollout_fleet.main import run_rollout

    index = _worker_index(config.rollout.worker_id)
    return _with_prometheus(
        config,
        "rollout",
        index,
        lambda: run_rollout(
            config.shared,
            config.broker,
            config.engine,
            config.rollout,
            config.learner.groups_per_step,
            adapter_name=config.served_adapter_name(),
        ),
    )


def _run_eval(config: StreamRLConfig) -> int:
    from rollout_fleet.evaluator import run_evaluator

    return _with_prometheus(
        config, "eval", 0, lambda: run_evaluator(config.shared, config.broker, config.rollout, config.eval)
    )


def _run_archive(config: StreamRLConfig) -> int:
    from archiver.archive import run_archive

    return run_archive(config.shared, config.broker, config.archive)


def _run_dashboard(config: StreamRLConfig) -> int:
    from streamrl.dashboard import run_dashboard

    archive = config.archive.directory(config.shared) if config.archive.wandb_artifact else None
    return run_dashboard(
        config.shared,
        config.dashboard,
        config.broker,
        config.learner.wandb_mode,
        config.model_dump(mode="json"),
        archive,
    )


def _run_router(config: StreamRLConfig) -> int:
    from common.auth import run_secret
    from rollout_fleet.sglang_router import router_endpoint

    return router_endpoint(config.engine, config.rollout, run_secret(config.shared))


def _run_up(config: StreamRLConfig) -> int:
    from streamrl.up import run_up

    return run_up(config)


def _run_plan(config: StreamRLConfig) -> int:
    """The device plan and weight transport ``up`` would start with these options, printed; nothing started."""
    from streamrl.devices import plan_for
    from streamrl.ray_launcher import describe_cluster_plan

    try:
        lines = describe_cluster_plan(config) if config.up.launcher == "ray" else plan_for(config).describe()
    except ConfigError as exc:
        print(f"streamrl plan: {exc}", file=sys.stderr)
        return 2
    sync = config.weight_sync.for_placement(config.shared.placement, config.shared.eta)
    for line in lines:
        print(line)
    released = ", ".join(sync.release_memory or []) or "nothing"
    print(
        f"weight sync: transport {sync.transport}; engines release {released} while the learner trains "
        f"(shared.eta = {config.shared.eta})"
    )
    return 0


COMMANDS: dict[str, Command] = {
    "redis": Command(
        "run the embedded Redis server until stopped",
        ("shared", "redis"),
        _run_redis,
        # its Prometheus port, and the ports promised to the run's other servers, which it must not draw
        ("dashboard.metrics_base_port", *PROMISED_PORT_FIELDS),
    ),
    "engine": Command("serve a model over SGLang's HTTP protocol", ("shared", "engine"), _run_engine),
    "rollout": Command(
        "run rollout workers writing trajectory groups to the stream",
        ("shared", "broker", "engine", "rollout"),
        _run_rollout,
        # admission counts in learner steps; LoRA served by name puts the adapter's name in every request
        ("learner.groups_per_step", *LORA_NAMING_FIELDS, *METRICS_FIELDS),
    ),
    "learner": Command(
        "train from the stream and publish weights",
        ("shared", "broker", "learner", "weight_sync"),
        _run_learner,
        METRICS_FIELDS,
    ),
    "sft": Command(
        "supervised training of shared.model_path on a JSONL dataset (FSDP2, checkpoints, HF export)",
        ("shared", "sft"),
        _run_sft,
    ),
    "eval": Command(
        "evaluate held-out accuracy through the engines as training goes",
        ("shared", "broker", "rollout", "eval"),
        _run_eval,
        METRICS_FIELDS,
    ),
    "archive": Command(
        "archive every trajectory group with its outcome as Parquet in the run directory",
        ("shared", "broker", "archive"),
        _run_archive,
    ),
    "router": Command(
        "run an sglang-router in front of the engines (rollout.router = sglang)",
        ("shared", "engine", "rollout"),
        _run_router,
    ),
    "dashboard": Command(
        "serve the live dashboard, and log the run to its wandb run",
        ("shared", "dashboard", "broker"),
        _run_dashboard,
        ("learner.wandb_mode", "archive.wandb_artifact", "archive.dir"),
    ),
    "up": Command(
        "start every role under one supervisor: on this node, or on a Ray cluster (up.launcher)",
        RUN_SECTIONS,
        _run_up,
    ),
    "plan": Command(
        "print the device plan and weight transport `up` would start with, and exit (2 if it does not fit)",
        RUN_SECTIONS,
        _run_plan,
    ),
}


def _resume_args(name: str, args: list[str]) -> list[str]:
    """``up --resume RUN_DIR``: the run's resolved config first, then whatever else was given."""
    if name != "up" or "--resume" not in args and not any(a.startswith("--resume=") for a in args):
        return args
    out, run_dir = [], None
    i = 0
    while i < len(args):
        if args[i] == "--resume":
            run_dir, i = args[i + 1] if i + 1 < len(args) else None, i + 2
        elif args[i].startswith("--resume="):
            run_dir, i = args[i].split("=", 1)[1], i + 1
        else:
            out.append(args[i])
            i += 1
    if not run_dir or not (Path(run_dir) / "config.toml").is_file():
        raise ConfigError(f"--resume {run_dir!r}: no run directory with a config.toml there")
    return ["--config", str(Path(run_dir) / "config.toml"), f"--shared.run_dir={run_dir}", *out]


def _model_command(args: list[str]) -> int:
    """``streamrl model init [--out DIR --steps N --seed S ...]``: build (or find cached) the warm-started tiny
    model through the supervised trainer; the options are streamrl.warm_start's (``streamrl model init --help``)."""
    if not args or args[0] != "init":
        print(
            "usage: streamrl model init [--task TASK] [--out DIR] [--steps N] [--seed S] [--help]\n"
            "       streamrl model init --shape qwen2.5-0.5b [--out DIR]",
            file=sys.stderr,
        )
        return 2
    if any(a == "--shape" or a.startswith("--shape=") for a in args[1:]):
        from rollout_fleet.shapes import main as shapes_main

        return shapes_main(args[1:])
    from streamrl.warm_start import main as warm_start_main

    return warm_start_main(args[1:])


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name == "model":
        return _model_command(rest)
    if name == "eval" and "--adversarial" in rest:  # a check of the verifiers: no config, no engines
        from rollout_fleet.adversarial import main as adversarial_main

        return adversarial_main([a for a in rest if a != "--adversarial"])
    if name == "audit":
        from streamrl.audit import main as audit_main

        return audit_main(rest)
    if name == "export":
        from streamrl.export import main as export_main

        return export_main(rest)
    if name == "replay":
        from streamrl.replay import main as replay_main

        return replay_main(rest)
    if name == "compose":
        from streamrl.compose import main as compose_main

        return compose_main(rest)
    if name == "inspect":
        from streamrl.inspect import main as inspect_main

        return inspect_main(rest)
    command = COMMANDS.get(name)
    if command is None:
        print(f"streamrl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        print(
            f"usage: streamrl {name} [--config FILE.toml] [--section.field=value ...]\n\n{command.summary}\n"
        )
        print(render_help(StreamRLConfig, command.sections, command.fields))
        return 0
    try:
        rest = _resume_args(name, rest)
        config = load(rest)
    except ConfigError as exc:
        print(f"streamrl {name}: {exc}", file=sys.stderr)
        return 2
    if name not in (
        "learner",
        "sft",
    ):  # each learner rank sets up its own logging, with its rank in the format
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
        )
    # a rank runs from the file its launcher wrote; `plan` is a dry run and writes nothing
    if "RANK" not in os.environ and name != "plan":
        dump_config(config, resolved_config_path(config, name))
    try:
        return command.run(config)
    except ConfigError as exc:  # a value that only the role itself can refuse (a path, a core, a model)
        print(f"streamrl {name}: {exc}", file=sys.stderr)
        return 2


def resolved_config_path(config: StreamRLConfig, command: str) -> Path:
    """Where ``streamrl COMMAND`` writes the config it runs with: ``RUN_DIR/config.COMMAND.toml``, one per
    engine port and per rollout worker (several of those run in one run directory)."""
    name = command
    if command == "engine":
        name = f"engine-{config.engine.port or config.engine.base_port}"
    elif command == "rollout" and config.rollout.worker_id:
        name = f"rollout-{config.rollout.worker_id}"
    return Path(config.shared.run_dir) / f"config.{name}.toml"


if __name__ == "__main__":
    sys.exit(main())
