"""``streamrl up``: every role on one node under one supervisor, a live status line, and a summary.

Order of start (each waits for the previous to be ready): Redis, the engines, a held-out evaluation of the
starting policy, the learner (ready once it has published version 0 to the engines), the rollout workers, the
evaluator (unless ``eval.every_versions`` is 0) and the dashboard. The run ends when the
learner reaches ``learner.max_steps`` (then the final policy is evaluated through the engines and
``RUN_DIR/summary.json`` written), when a role has died more often than its restart budget (``up.*_restarts``
within ``up.restart_window_s``; the others are stopped and the reason printed), or on SIGTERM / Ctrl-C (every
role drains and checkpoints). Every role is restarted when it dies: Redis on its own port and AOF (clients
reconnect), an engine (the learner brings it back to the current policy before it serves rollouts), the learner
from its last durable checkpoint, the rollout workers, the evaluator and the dashboard.

``streamrl up --resume RUN_DIR`` continues a stopped run from its checkpoint and its stream, with no sample
trained twice. One ``up`` at a time holds a run directory (``RUN_DIR/up.lock``); processes of an earlier ``up``
of the same directory that are still alive (listed in ``RUN_DIR/processes.json``) are stopped first.
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
from typing import IO, Any

import redis

from broker.client import BrokerKeys
from broker.configlib import ConfigError, dump_config
from broker.discovery import resolve_redis_url, url_file
from broker.lifecycle import read_records, stop_leftovers
from broker.server import free_port
from rollout_fleet.fleet import engine_ranks
from streamrl.config import StreamRLConfig
from streamrl.status import StatusReader
from streamrl.supervisor import ChildSpec, Supervisor

log = logging.getLogger("streamrl.up")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _redis_ready(config: StreamRLConfig) -> bool:
    path = url_file(config.shared)
    if not path.is_file():
        return False
    return bool(redis.Redis.from_url(path.read_text().strip(), socket_timeout=2).ping())


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
    """Fill in what ``up`` decides: the model (the task's cached warm-started tiny model by default), free ports,
    the engine URLs every role uses. Returns the resolved config, also written to RUN_DIR/config.toml."""
    cfg = config.model_copy(deep=True)
    if cfg.shared.model_path is None:
        from rollout_fleet.warmstart import warm_model_for_task

        print("streamrl up: preparing the warm-started tiny model (cached after the first run)", flush=True)
        cfg.shared.model_path = warm_model_for_task(cfg.rollout.task.name)
    ports = [free_port() for _ in range(cfg.engine.count)]
    urls = [f"http://{cfg.engine.host}:{p}" for p in ports]
    cfg.rollout.engine_urls = urls
    cfg.weight_sync.engine_urls = urls
    cfg.weight_sync.engine_ranks = engine_ranks(cfg.engine)
    if cfg.dashboard.port == 0:
        cfg.dashboard.port = free_port()
    cfg.shared.run_dir = Path(cfg.shared.run_dir).resolve()
    dump_config(cfg, cfg.shared.run_dir / "config.toml")
    return cfg


def child_specs(cfg: StreamRLConfig, config_path: Path) -> tuple[list[ChildSpec], list[ChildSpec]]:
    """(children started before the baseline evaluation, children started after it). Each is restarted when
    it dies, within its budget ``up.<role>_restarts``."""
    up = cfg.up

    def role(name: str, command: str, budget: int, *args: str, **spec: Any) -> ChildSpec:
        spec.setdefault("restart", "on-failure")
        return ChildSpec(name, _argv(command, config_path, *args), max_restarts=budget, **spec)

    before: list[ChildSpec] = []
    if not cfg.shared.redis_url:
        before.append(role("redis", "redis", up.redis_restarts, ready=lambda: _redis_ready(cfg)))
    for i, url in enumerate(cfg.rollout.engine_urls):
        port, seed = url.rsplit(":", 1)[1], json.dumps(cfg.engine.seed_of(i))
        engine = role(
            f"engine-{i}", "engine", up.engine_restarts, f"--engine.port={port}", f"--engine.seed={seed}",
            ready=lambda u=url: _http_ok(f"{u}/model_info"),
            restart="always",  # an engine exits only when told to (or when it dies)
        )  # fmt: skip
        before.append(engine)
    # Rollouts start once the learner has published its weights: the clock of a run (its first rollout
    # request) then leaves out the learner's start-up, as a trainer's clock leaves out model loading. A learner
    # that dies is restarted: it resumes from its last durable checkpoint.
    learner = role(
        "learner", "learner", up.learner_restarts,
        finishes_run=cfg.learner.max_steps > 0,
        ready=lambda: _version_published(cfg),
        ready_timeout_s=cfg.weight_sync.wait_for_engines_s + cfg.weight_sync.timeout_s,
    )  # fmt: skip
    after = [learner]
    for w in range(cfg.rollout.workers):
        after.append(role(f"rollout-{w}", "rollout", up.rollout_restarts, f"--rollout.worker_id=worker-{w}"))
    if cfg.eval.every_versions > 0:
        after.append(role("eval", "eval", up.eval_restarts))
    dash = f"http://{cfg.dashboard.host}:{cfg.dashboard.port}/"
    after.append(role("dashboard", "dashboard", up.dashboard_restarts, ready=lambda: _http_ok(dash)))
    return before, after


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
    cfg = prepare(config)
    run_dir = cfg.shared.run_dir
    print(f"streamrl up: run directory {run_dir} (logs in {run_dir / 'logs'})", flush=True)
    sup = Supervisor(
        run_dir / "logs",
        grace_s=cfg.up.grace_s,
        restart_window_s=cfg.up.restart_window_s,
        restart_delay_s=cfg.up.restart_delay_s,
        records_path=run_dir / PROCESSES_FILE,
        say=lambda message: print(f"streamrl up: {message}", flush=True),
    )
    sup.install_signal_handlers()
    before, after = child_specs(cfg, run_dir / "config.toml")
    status = StatusReader(cfg)
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    code = 1
    try:
        for spec in before:
            sup.start(spec)
        summary["eval_before"] = evaluate_now(cfg, "before")
        gen_started = time.time()
        summary["training_started_at"] = gen_started
        for spec in after:
            sup.start(spec)
        code = sup.watch(on_tick=status.ticker(cfg.up.status_interval_s), stop_at_end=False)
        summary["training_wall_seconds"] = time.time() - gen_started
        if code == 0 and not sup.stop_requested.is_set():
            summary["eval_after"] = evaluate_now(cfg, "after", published_version(cfg))
    except Exception as exc:  # a start that failed: say which role and why, stop the rest
        log.error("%s", exc)
        print(f"streamrl up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        totals = status.final_totals()  # before Redis stops
        status.close()  # Redis waits for its clients to leave before it stops
        sup.stop_all()
    if sup.failure:
        print(f"streamrl up: stopped because {sup.failure}", file=sys.stderr, flush=True)
    write_summary(cfg, summary, started, totals)
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
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    out = {
        "eval_reward_before": before.get("greedy_accuracy"),
        "eval_reward_after": after.get("greedy_accuracy"),
        "eval_sampled_before": before.get("sampled_accuracy"),
        "eval_sampled_after": after.get("sampled_accuracy"),
        "eval_version_before": before.get("policy_version"),
        "eval_version_after": after.get("policy_version"),
        # the final policy's version, and whether eval_*_after measured it (false: a warning was printed)
        "final_policy_version": after.get("version_asked"),
        "eval_after_is_final_policy": is_of_version(after),
        **totals,
        "wall_seconds": time.time() - started,
        "training_wall_seconds": summary.get("training_wall_seconds"),
        "training_started_at": summary.get("training_started_at"),
        "run_dir": str(cfg.shared.run_dir),
    }
    path = cfg.shared.run_dir / "summary.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("\n" + format_summary(out) + f"\n\nsummary: {path}", flush=True)


def _audit_line(report: dict[str, Any] | None) -> str:
    if not report:
        return "  groups: no audit (Redis did not answer)"
    line = (
        f"  groups: {report['generated']} generated, {report['trained']} trained, {report['dropped']} dropped, "
        f"{report['dead_lettered']} dead-lettered, {report['pending']} pending, "
        f"{report['trained_twice']} trained twice, {report['lost']} lost"
    )
    return line if report["ok"] else line + "   NOT OK: streamrl audit RUN_DIR says which"


def format_summary(s: dict[str, Any]) -> str:
    def pct(x: Any) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    dropped = s.get("samples_dropped_by_reason") or {}
    after_note = ""
    if s.get("eval_after_is_final_policy") is False:
        after_note = f"   (NOT the final policy {s.get('final_policy_version')}: no engine served it)"
    lines = [
        "streamrl run summary",
        f"  held-out accuracy (greedy): {pct(s['eval_reward_before'])} -> {pct(s['eval_reward_after'])}"
        + after_note,
        f"  held-out accuracy (sampled): {pct(s['eval_sampled_before'])} -> {pct(s['eval_sampled_after'])}",
        f"  steps: {s.get('steps')}   policy version: {s.get('policy_version')}",
        f"  samples trained: {s.get('samples_trained')}   dropped: {s.get('samples_dropped')} {dropped}",
        f"  output tokens per sample: {s.get('mean_output_tokens') or 0:.0f} mean, "
        f"{s.get('truncated_samples') or 0} cut at the output budget",
        _audit_line(s.get("audit")),
        f"  wall time: {s['wall_seconds']:.0f} s",
        f"  run directory: {s['run_dir']}",
    ]
    return "\n".join(lines)
