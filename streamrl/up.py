"""``streamrl up``: every role on one node under one supervisor, a live status line, and a summary.

Order of start (each stage waits for the previous one to be ready): Redis and the engines side by side, the
archiver (and an sglang-router), a held-out evaluation of the starting policy, the learner (ready once it has
published version 0 to the engines; on a fresh disaggregated run it starts during that evaluation), then the
rollout workers, the evaluator (unless ``eval.every_versions`` is 0) and the dashboard. The run ends when the
learner reaches ``learner.max_steps`` (then the final policy is evaluated through the engines and
``RUN_DIR/summary.json`` written), when a role has died more often than its restart budget (``up.*_restarts`` within ``up.restart_window_s``; the others are stopped and the reason
printed), or on SIGTERM / Ctrl-C (every role drains and checkpoints). Every role is restarted when it dies: Redis
on its own port and AOF (clients reconnect), an engine (the learner brings it back to the current policy before
it serves rollouts), the learner from its last durable checkpoint, the rollout workers, the evaluator and the
dashboard.

With ``--up.launcher=ray`` the same roles, the same commands and the same supervision run on a Ray cluster:
streamrl.ray_launcher places each role process (docs/cluster.md) and hands the supervisor a handle on it.

``streamrl up --resume RUN_DIR`` continues a stopped run from its checkpoint and its stream, with no sample
trained twice. One ``up`` at a time holds a run directory (``RUN_DIR/up.lock``); processes of an earlier ``up``
of the same directory that are still alive (listed in ``RUN_DIR/processes.json``) are stopped first.

``RUN_DIR/manifest.json`` (streamrl.manifest) records what produced the run: written before any role starts,
completed at the end. A later ``up`` of the same directory appends to its ``resumes`` and refuses to start when
the model or the grader changed since, unless ``up.allow_changed_run`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis

from broker.client import BrokerKeys
from broker.server import free_port
from common.auth import auth_headers, run_secret
from common.configlib import ConfigError, dump_config
from common.discovery import RedisNotFound, resolve_redis_url, url_file
from common.lifecycle import read_records, stop_leftovers
from rollout_fleet.fleet import engine_ranks
from streamrl import devices, manifest
from streamrl.config import StreamRLConfig
from streamrl.status import StatusReader
from streamrl.summary import (
    GREEDY_AFTER,
    GREEDY_BEFORE,
    LAST_IS_FINAL,
    LAST_VERSION,
    LAST_VERSION_MAX,
    SAMPLED_AFTER,
    SAMPLED_BEFORE,
    accuracy_line,
)
from streamrl.supervisor import ChildSpec, Supervisor

if TYPE_CHECKING:
    from streamrl.ray_launcher import RayLauncher

log = logging.getLogger("streamrl.up")


def _http_ok(url: str, headers: dict[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _router_ready(config: StreamRLConfig) -> bool:
    """The sglang-router answers and counts every engine healthy."""
    from rollout_fleet.sglang_router import healthy_workers

    try:
        healthy = healthy_workers(str(config.rollout.sglang_router_url), api_key=run_secret(config.shared))
    except (OSError, ValueError):
        return False
    return len(healthy) >= len(config.rollout.engine_urls)


def _redis_ready(config: StreamRLConfig) -> bool:
    path = url_file(config.shared)
    if not path.is_file():
        return False
    return bool(redis.Redis.from_url(path.read_text().strip(), socket_timeout=2).ping())


def _archive_ready(config: StreamRLConfig) -> bool:
    """The archiver's consumer group exists: every entry produced from now on waits for it."""
    keys = BrokerKeys.of(config.shared, config.broker)
    try:
        with contextlib.closing(
            redis.Redis.from_url(resolve_redis_url(config.shared), socket_timeout=2)
        ) as c:
            groups = c.xinfo_groups(keys.stream)
    except (redis.RedisError, RedisNotFound):
        return False
    return any(
        g["name"] in (config.broker.archive_group, config.broker.archive_group.encode()) for g in groups
    )


def _version_published(config: StreamRLConfig) -> bool:
    """The learner is ready once it has published a policy version (its weights are on the engines). Reads the
    run's Redis wherever it is: the embedded server's URL file, or ``shared.redis_url`` / REDIS_URL."""
    client = redis.Redis.from_url(resolve_redis_url(config.shared), socket_timeout=2)
    try:
        return bool(client.exists(BrokerKeys.of(config.shared, config.broker).version))
    finally:
        client.close()


def _argv(role: str, config_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "streamrl", role, "--config", str(config_path), *extra]


def prepare(config: StreamRLConfig) -> StreamRLConfig:
    """Fill in what ``up`` decides (:func:`resolve`) and write the resolved config to RUN_DIR/config.toml."""
    cfg = resolve(config)
    write_config(cfg)
    return cfg


def resolve(config: StreamRLConfig) -> StreamRLConfig:
    """Fill in what ``up`` decides: the model (the task's cached warm-started tiny model by default), free ports,
    the engine URLs every role uses. Returns the resolved config."""
    cfg = config.model_copy(deep=True)
    if cfg.shared.model_path is None:
        from streamrl.warm_start import warm_model_for_task

        print("streamrl up: preparing the warm-started tiny model (cached after the first run)", flush=True)
        cfg.shared.model_path = warm_model_for_task(cfg.rollout.task.name)
    ports = [free_port() for _ in range(cfg.engine.count)]
    urls = [f"http://{cfg.engine.host}:{p}" for p in ports]
    cfg.rollout.engine_urls = urls
    cfg.weight_sync.engine_urls = urls
    cfg.weight_sync.engine_ranks = engine_ranks(cfg.engine)
    # transport and memory release as the placement and eta decide, written out for every role to read
    cfg.weight_sync = cfg.weight_sync.for_placement(cfg.shared.placement, cfg.shared.eta)
    if (
        cfg.rollout.router == "sglang"
        and not cfg.rollout.sglang_router_url
        and not cfg.rollout.sglang_router_port
    ):
        cfg.rollout.sglang_router_port = free_port()  # up starts the router (child_specs) on this port
    if cfg.rollout.router == "sglang" and cfg.rollout.sglang_router_port:
        cfg.rollout.sglang_router_url = f"http://{cfg.engine.host}:{cfg.rollout.sglang_router_port}"
    if cfg.dashboard.port == 0:
        cfg.dashboard.port = free_port()
    cfg.shared.run_dir = Path(cfg.shared.run_dir).resolve()
    return cfg


def promised_ports(cfg: StreamRLConfig) -> set[int]:
    """The ports :func:`resolve` gave the run's servers (engines, the sglang router, the dashboard). Redis starts
    before any of them binds and draws its own port, so it must be told: a port drawn twice is a start that
    fails with "address already in use" (a `make run` did)."""
    ports = {urlsplit(url).port for url in cfg.rollout.engine_urls}
    ports |= {cfg.rollout.sglang_router_port, cfg.dashboard.port}
    return {p for p in ports if p}


def write_config(cfg: StreamRLConfig) -> None:
    """RUN_DIR/config.toml, which ``up --resume`` reads back. ``up.allow_changed_run`` is left out: it lets
    this ``up`` go on past a changed model or grader, never a later resume."""
    saved = cfg.model_copy(deep=True)
    saved.up.allow_changed_run = False
    dump_config(saved, cfg.shared.run_dir / "config.toml")


def start_manifest(cfg: StreamRLConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Write RUN_DIR/manifest.json before anything starts: a new manifest, or, when the run directory has one,
    this resume appended to it after the check that its model and grader did not change (ConfigError naming
    each change unless ``up.allow_changed_run``). Returns the manifest written."""
    path = cfg.shared.run_dir / manifest.MANIFEST_FILE
    record = manifest.run_record(cfg, argv)
    try:
        doc = manifest.read_manifest(path)
    except ValueError as exc:
        if not cfg.up.allow_changed_run:
            raise ConfigError(f"{exc}; fix or remove it, or set --up.allow_changed_run=true") from None
        print(f"streamrl up: WARNING: {exc}; writing a new manifest", file=sys.stderr, flush=True)
        doc = None
    if doc is None:
        doc = manifest.new_manifest(record, cfg.shared.run_dir, cfg.shared.run_id)
        if (cfg.shared.run_dir / "checkpoints").exists():
            doc["note"] = "written on a later up of a run directory that had no manifest"
    else:
        try:
            found = manifest.check_resume(doc, record, cfg.up.allow_changed_run, path)
        except manifest.ChangedRunError as exc:
            raise ConfigError(str(exc)) from None
        for change in found:
            print(f"streamrl up: WARNING: going on with a changed {change}", file=sys.stderr, flush=True)
        doc = manifest.add_resume(doc, record)
    manifest.write_manifest(path, doc)
    return doc


def record_redis(cfg: StreamRLConfig, doc: dict[str, Any]) -> dict[str, Any]:
    """The manifest with the run's Redis server version (``INFO server``); unchanged when Redis does not answer."""
    try:
        client = redis.Redis.from_url(resolve_redis_url(cfg.shared), socket_timeout=5)
        try:
            info = client.info("server")
        finally:
            client.close()
    except (redis.RedisError, OSError, RuntimeError) as exc:  # RuntimeError: common.discovery.RedisNotFound
        log.warning("manifest: no Redis server version (%s)", exc)
        return doc
    doc = manifest.with_redis(doc, info)
    manifest.write_manifest(cfg.shared.run_dir / manifest.MANIFEST_FILE, doc)
    return doc


def finish_manifest(cfg: StreamRLConfig, doc: dict[str, Any], code: int, totals: dict[str, Any]) -> None:
    """Complete the manifest at the end: end time, exit status, final step and policy version."""
    doc = manifest.finish(doc, code, totals.get("steps"), totals.get("policy_version"))
    manifest.write_manifest(cfg.shared.run_dir / manifest.MANIFEST_FILE, doc)


def child_specs(
    cfg: StreamRLConfig, config_path: Path, plan: devices.DevicePlan | None = None
) -> tuple[list[list[ChildSpec]], list[list[ChildSpec]]]:
    """(children started before the baseline evaluation, children started after it), each a list of stages: the
    children of a stage start together and the next stage starts once all of them are ready. Each child is
    restarted when it dies, within its budget ``up.<role>_restarts``. With a device ``plan`` each child sees the
    GPUs the plan gives it (CUDA_VISIBLE_DEVICES), and a role that needs none sees none."""
    up = cfg.up

    def role(name: str, command: str, budget: int, *args: str, **spec: Any) -> ChildSpec:
        spec.setdefault("restart", "on-failure")
        if plan is not None:
            spec.setdefault("env", plan.no_gpu_env())
        return ChildSpec(name, _argv(command, config_path, *args), max_restarts=budget, **spec)

    # The engines need nothing of Redis: they start beside it. The archiver needs Redis, the router the engines.
    servers: list[ChildSpec] = []
    then: list[ChildSpec] = []
    if not cfg.shared.redis_url:
        servers.append(role("redis", "redis", up.redis_restarts, ready=lambda: _redis_ready(cfg)))
    if cfg.archive.enabled:  # before any group is produced, so its consumer group sees every entry
        then.append(role("archive", "archive", up.archive_restarts, ready=lambda: _archive_ready(cfg),
                         essential=False))  # fmt: skip
    key = auth_headers(run_secret(cfg.shared))  # the run secret, created here before any server starts
    for i, url in enumerate(cfg.rollout.engine_urls):
        port, seed = url.rsplit(":", 1)[1], json.dumps(cfg.engine.seed_of(i))
        engine = role(
            f"engine-{i}", "engine", up.engine_restarts, f"--engine.port={port}", f"--engine.seed={seed}",
            ready=lambda u=url: _http_ok(f"{u}/model_info", key),
            restart="always",  # an engine exits only when told to (or when it dies)
            **({} if plan is None else {"env": plan.engine_env(i)}),
        )  # fmt: skip
        servers.append(engine)
    if cfg.rollout.router == "sglang" and cfg.rollout.sglang_router_port:  # an sglang-router in front of them
        then.append(role(
            "router", "router", up.engine_restarts,
            ready=lambda: _router_ready(cfg),
            restart="always",
        ))  # fmt: skip
    # Rollouts start once the learner has published its weights: the clock of a run (its first rollout
    # request) then leaves out the learner's start-up, as a trainer's clock leaves out model loading. A learner
    # that dies is restarted: it resumes from its last durable checkpoint.
    learner = role(
        "learner", "learner", up.learner_restarts,
        finishes_run=cfg.learner.max_steps > 0,
        ready=lambda: _version_published(cfg),
        ready_timeout_s=cfg.weight_sync.wait_for_engines_s + cfg.weight_sync.timeout_s,
        **({} if plan is None else {"env": plan.learner_env()}),  # each rank: cuda:LOCAL_RANK inside it
    )  # fmt: skip
    clients: list[ChildSpec] = []
    for w in range(cfg.rollout.workers):
        clients.append(
            role(f"rollout-{w}", "rollout", up.rollout_restarts, f"--rollout.worker_id=worker-{w}")
        )
    if cfg.eval.every_versions > 0:
        clients.append(role("eval", "eval", up.eval_restarts))
    dash = f"http://{cfg.dashboard.host}:{cfg.dashboard.port}/"
    clients.append(role("dashboard", "dashboard", up.dashboard_restarts, ready=lambda: _http_ok(dash, key)))
    return [stage for stage in (servers, then) if stage], [[learner], clients]


def learner_starts_during_baseline(cfg: StreamRLConfig) -> bool:
    """Whether the learner starts (imports, model load, update group) while the baseline evaluation runs, instead
    of after it: on a fresh disaggregated run it publishes version 0 without sending weights (the engines start
    from them), so the evaluation still measures version 0. A learner with a checkpoint to resume sends that
    checkpoint's weights, and a colocated one shares the engines' devices: they start after the evaluation."""
    checkpoints = cfg.shared.run_dir / "checkpoints"
    resumable = checkpoints.is_dir() and any(checkpoints.iterdir())
    return cfg.shared.placement == "disaggregated" and not resumable


def evaluate_now(cfg: StreamRLConfig, label: str, version: int = 0) -> dict[str, float]:
    """Held-out greedy and sampled accuracy of policy ``version`` (on the engines that serve it), written to the
    eval stream. When no engine serves it, what the engines do serve is evaluated instead and the result says
    so loudly (``is_version_asked`` false): a number is never passed off as another policy's."""
    from rollout_fleet.evaluator import NoEngineAtVersion, run_evaluation_once

    try:
        result = asyncio.run(run_evaluation_once(cfg.shared, cfg.rollout, cfg.eval, label, version))
        result["is_version_asked"] = 1.0
    except NoEngineAtVersion as exc:
        print(
            f"streamrl up: WARNING: the {label} evaluation should be of policy version {version}, but {exc}; "
            "evaluating what the engines serve instead",
            file=sys.stderr,
            flush=True,
        )
        result = asyncio.run(run_evaluation_once(cfg.shared, cfg.rollout, cfg.eval, label, 0))
        result["is_version_asked"] = 0.0
    result["version_asked"] = float(version)
    print(
        f"streamrl up: held-out accuracy ({label}, version {result['policy_version']:.0f}): "
        f"greedy {result['greedy_accuracy']:.3f}, sampled {result['sampled_accuracy']:.3f}",
        flush=True,
    )
    return result


def published_version(cfg: StreamRLConfig) -> int:
    """The policy version the learner last announced (0 when none)."""
    client = redis.Redis.from_url(resolve_redis_url(cfg.shared), socket_timeout=5)
    try:
        raw = client.get(BrokerKeys.of(cfg.shared, cfg.broker).version)
    finally:
        client.close()
    return 0 if raw is None else int(raw)


PROCESSES_FILE = "processes.json"  # the supervisor's children of the latest up of a run directory
LOCK_FILE = "up.lock"


@contextlib.contextmanager
def hold_run_directory(run_dir: Path) -> Iterator[IO[str]]:
    """The run directory's lock for the life of this ``up``; ConfigError when another ``up`` holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fh = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the life of the run
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            raise ConfigError(
                f"shared.run_dir = {str(run_dir)!r}: another streamrl up (pid {holder}) is running this run"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        yield fh
    finally:
        fh.close()


def stop_earlier_processes(cfg: StreamRLConfig) -> None:
    """Stop what an earlier ``up`` of this run directory left running (its supervisor killed outright, say):
    two learners or two Redis servers on one run directory must never run at once."""
    records = read_records(cfg.shared.run_dir / PROCESSES_FILE)
    found = stop_leftovers(records, cfg.up.grace_s, lambda m: print(f"streamrl up: {m}", flush=True))
    if found:
        print(f"streamrl up: stopped {found} process(es) of an earlier up of this run directory", flush=True)


def run_up(config: StreamRLConfig) -> int:
    try:
        with hold_run_directory(Path(config.shared.run_dir).resolve()):
            return _run_up(config)
    except ConfigError as exc:
        print(f"streamrl up: {exc}", file=sys.stderr, flush=True)
        return 2


def _run_up(config: StreamRLConfig) -> int:
    started = time.time()
    stop_earlier_processes(config)
    if config.up.launcher == "local":
        return _supervise(config, started, None)
    from streamrl.ray_launcher import RayLauncher

    launcher = RayLauncher(config)
    try:
        return _supervise(config, started, launcher)
    finally:
        launcher.shutdown()


def _supervise(config: StreamRLConfig, started: float, launcher: RayLauncher | None) -> int:
    """Start every role in order and watch them: as local child processes (``launcher`` None) or through the Ray
    launcher (streamrl.ray_launcher), which places each role and hands the supervisor a handle on it."""
    # The device plan first: a plan that does not fit is refused before anything is built or started. On a Ray
    # cluster the launcher places devices by Ray resources of the plan's shape instead.
    plan = devices.plan_for(config) if launcher is None else None
    cfg = resolve(config)
    if launcher is not None:
        cfg = launcher.place(cfg)  # the engines' nodes decide their URLs, which every role reads
    run_manifest = start_manifest(cfg)  # refuses a resume whose model or grader changed, before anything runs
    write_config(cfg)
    run_dir = cfg.shared.run_dir
    print(f"streamrl up: run directory {run_dir} (logs in {run_dir / 'logs'})", flush=True)
    if plan is not None:
        for line in plan.describe():
            print(f"streamrl up: {line}", flush=True)
        devices.write_plan(plan, run_dir)
        run_manifest = manifest.with_devices(run_manifest, plan.to_json())
        manifest.write_manifest(run_dir / manifest.MANIFEST_FILE, run_manifest)
    sup = Supervisor(
        run_dir / "logs",
        grace_s=cfg.up.grace_s,
        restart_window_s=cfg.up.restart_window_s,
        restart_delay_s=cfg.up.restart_delay_s,
        records_path=run_dir / PROCESSES_FILE,
        say=lambda message: print(f"streamrl up: {message}", flush=True),
        spawn=None if launcher is None else launcher.spawn,
        log_max_bytes=int(cfg.up.log_max_mb * 2**20),
        log_keep=cfg.up.log_keep,
    )
    sup.install_signal_handlers()
    before, after = child_specs(cfg, run_dir / "config.toml", plan)
    if launcher is not None:
        before, after = launcher.adapt(before, after)
    status = StatusReader(cfg)
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    code = 1
    try:
        for stage in before:
            sup.start_together(stage)
        run_manifest = record_redis(cfg, run_manifest)
        early = sup.spawn_together(after[0]) if learner_starts_during_baseline(cfg) else []
        summary["eval_before"] = evaluate_now(cfg, "before")
        sup.wait_ready(early)
        gen_started = time.time()
        summary["training_started_at"] = gen_started
        for stage in after[1 if early else 0 :]:
            sup.start_together(stage)
        code = sup.watch(on_tick=status.ticker(cfg.up.status_interval_s), stop_at_end=False)
        summary["training_wall_seconds"] = time.time() - gen_started
        if code == 0 and not sup.stop_requested.is_set():
            summary["eval_after"] = evaluate_now(cfg, "after", published_version(cfg))
    except Exception as exc:  # a start that failed: say which role and why, stop the rest
        log.error("%s", exc)
        print(f"streamrl up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        # Every role but Redis first: each writes its last metrics point as it stops (a short run can end
        # before a rollout worker's first periodic point), and the archiver its last part. The learner and the
        # roles after it first, then the archiver (after the learner: its outcomes are final) and the engines,
        # the dashboard last: the run's wandb run (streamrl.wandb_log) gets every last point and the archive.
        sup.stop_all(keep=("dashboard", *(s.name for stage in before for s in stage)))
        sup.stop_all(keep=("dashboard", "redis"))
        sup.stop_all(keep=("redis",))
        totals = status.final_totals()
        status.close()  # Redis waits for its clients to leave before it stops
        sup.stop_all()
    if sup.failure:
        print(f"streamrl up: stopped because {sup.failure}", file=sys.stderr, flush=True)
    write_summary(cfg, summary, started, totals)
    finish_manifest(cfg, run_manifest, code, totals)
    return code


def is_of_version(result: dict[str, float]) -> bool | None:
    """Whether an evaluation measured exactly the version it was asked for (every answer came from it); None
    when there was no evaluation."""
    if not result:
        return None
    asked = result.get("version_asked")
    return result.get("policy_version") == asked and result.get("policy_version_max") == asked


def write_summary(
    cfg: StreamRLConfig, summary: dict[str, Any], started: float, totals: dict[str, Any]
) -> None:
    out = summary_record(cfg, summary, started, totals)
    path = cfg.shared.run_dir / "summary.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("\n" + format_summary(out) + f"\n\nsummary: {path}", flush=True)


def summary_record(
    cfg: StreamRLConfig, summary: dict[str, Any], started: float, totals: dict[str, Any]
) -> dict[str, Any]:
    """summary.json's content: up's evaluations before and after (``summary``), the run's ``totals``
    (StatusReader.final_totals), and the final policy's version: the one the final evaluation asked for, else
    the version the learner last announced (a run stopped before its final evaluation)."""
    from rollout_fleet.evaluator import summary_fields as eval_summary_fields

    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    final = after.get("version_asked") if after else totals.get("published_version")
    last = (totals.get(LAST_VERSION), totals.get(LAST_VERSION_MAX))
    return {
        GREEDY_BEFORE: before.get("greedy_accuracy"),
        GREEDY_AFTER: after.get("greedy_accuracy"),
        SAMPLED_BEFORE: before.get("sampled_accuracy"),
        SAMPLED_AFTER: after.get("sampled_accuracy"),
        "eval_version_before": before.get("policy_version"),
        "eval_version_after": after.get("policy_version"),
        # the final policy's version, and whether eval_*_after measured it (false: a warning was printed)
        "final_policy_version": final,
        "eval_after_is_final_policy": is_of_version(after),
        **eval_summary_fields(cfg.rollout, cfg.eval, before, after),
        **totals,
        # whether the last evaluation (eval_last_*) was of the final policy; None when there was none
        LAST_IS_FINAL: None if last[0] is None else final is not None and last == (final, final),
        "wall_seconds": time.time() - started,
        "training_wall_seconds": summary.get("training_wall_seconds"),
        "training_started_at": summary.get("training_started_at"),
        "run_dir": str(cfg.shared.run_dir),
    }


def _audit_line(report: dict[str, Any] | None) -> str:
    if not report:
        return "  groups: no audit (Redis did not answer)"
    line = (
        f"  groups: {report['generated']} generated, {report['trained']} trained, {report['dropped']} dropped, "
        f"{report['dead_lettered']} dead-lettered, {report['pending']} pending, "
        f"{report['trained_twice']} trained twice, {report['lost']} lost"
    )
    return line if report["ok"] else line + "   NOT OK: streamrl audit RUN_DIR says which"


def _eval_detail_line(s: dict[str, Any]) -> str:
    """pass@k after training and the reward that scored the held-out answers."""
    reward = s.get("eval_reward") or {}
    passes = " ".join(f"@{k} {100 * v:.1f}%" for k, v in (s.get("eval_pass_at_k_after") or {}).items())
    return f"  held-out pass@k after: {passes or 'n/a'}   scored with: {reward.get('scorer')} ({reward.get('source')})"


def _episode_lines(e: dict[str, Any] | None) -> list[str]:
    """A multi-turn run's episode counters (nothing for a single-turn run)."""
    if not e:
        return []
    return [
        f"  episodes: {e['episodes']}, {e['turns_per_episode']:.2f} turns each, {e['tool_calls']} tool calls "
        f"({e['tool_errors']} failed), {e['observation_tokens']} observation tokens (masked), ended by "
        + (", ".join(f"{k} {v}" for k, v in sorted(e["ends"].items())) or "-")
    ]


def format_summary(s: dict[str, Any]) -> str:
    dropped = s.get("samples_dropped_by_reason") or {}
    lines = [
        "streamrl run summary",
        accuracy_line(s, "greedy"),
        accuracy_line(s, "sampled"),
        _eval_detail_line(s),
        f"  steps: {s.get('steps')}   policy version: {s.get('policy_version')}",
        f"  samples trained: {s.get('samples_trained')}   dropped: {s.get('samples_dropped')} {dropped}",
        f"  output tokens per sample: {s.get('mean_output_tokens') or 0:.0f} mean, "
        f"{s.get('truncated_samples') or 0} cut at the output budget",
        *_episode_lines(s.get("episodes")),
        _audit_line(s.get("audit")),
        f"  wall time: {s['wall_seconds']:.0f} s",
        f"  run directory: {s['run_dir']}",
    ]
    return "\n".join(lines)
