"""``streamrl up``: every role on one node under one supervisor, a live status line, and a summary.

Order of start (each waits for the previous to be ready): Redis, the engines, a held-out evaluation of the
starting policy, the learner (ready once it has published version 0 to the engines), the rollout workers, the
evaluator (unless ``eval.every_versions`` is 0) and the dashboard. The run ends when the
learner reaches ``learner.max_steps`` (then the final policy is evaluated through the engines and
``RUN_DIR/summary.json`` written), when a role dies (the others are stopped and the reason printed), or on
SIGTERM / Ctrl-C (every role drains and checkpoints). ``streamrl up --resume RUN_DIR`` continues a stopped
run from its checkpoint and its stream, with no sample trained twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis

from broker.client import BrokerKeys
from broker.configlib import dump_config
from broker.discovery import resolve_redis_url, url_file
from learner.distributed import free_port
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
    """Fill in what ``up`` decides: the model (the cached warm-started tiny model by default), free ports,
    the engine URLs every role uses. Returns the resolved config, also written to RUN_DIR/config.toml."""
    cfg = config.model_copy(deep=True)
    if cfg.shared.model_path is None:
        from rollout_fleet.warmstart import init_warm_model

        print("streamrl up: preparing the warm-started tiny model (cached after the first run)", flush=True)
        cfg.shared.model_path = init_warm_model()
    ports = [free_port() for _ in range(cfg.engine.count)]
    urls = [f"http://{cfg.engine.host}:{p}" for p in ports]
    cfg.rollout.engine_urls = urls
    cfg.weight_sync.engine_urls = urls
    if cfg.dashboard.port == 0:
        cfg.dashboard.port = free_port()
    cfg.shared.run_dir = Path(cfg.shared.run_dir).resolve()
    dump_config(cfg, cfg.shared.run_dir / "config.toml")
    return cfg


def child_specs(cfg: StreamRLConfig, config_path: Path) -> tuple[list[ChildSpec], list[ChildSpec]]:
    """(children started before the baseline evaluation, children started after it)."""
    before: list[ChildSpec] = []
    if not cfg.shared.redis_url:
        before.append(ChildSpec("redis", _argv("redis", config_path), ready=lambda: _redis_ready(cfg)))
    for i, url in enumerate(cfg.rollout.engine_urls):
        port = url.rsplit(":", 1)[1]
        before.append(
            ChildSpec(
                f"engine-{i}",
                _argv(
                    "engine",
                    config_path,
                    f"--engine.port={port}",
                    f"--engine.seed={json.dumps(cfg.engine.seed_of(i))}",
                ),
                ready=lambda u=url: _http_ok(f"{u}/model_info"),
                restart="on-failure",
                max_restarts=cfg.up.engine_restarts,
            )
        )
    # Rollouts start once the learner has published its weights: the clock of a run (its first rollout
    # request) then leaves out the learner's start-up, as a trainer's clock leaves out model loading.
    learner = ChildSpec(
        "learner",
        _argv("learner", config_path),
        finishes_run=cfg.learner.max_steps > 0,
        ready=lambda: _version_published(cfg),
        ready_timeout_s=cfg.weight_sync.wait_for_engines_s + cfg.weight_sync.timeout_s,
    )
    after = [learner]
    for w in range(cfg.rollout.workers):
        after.append(
            ChildSpec(f"rollout-{w}", _argv("rollout", config_path, f"--rollout.worker_id=worker-{w}"))
        )
    if cfg.eval.every_versions > 0:
        after.append(ChildSpec("eval", _argv("eval", config_path)))
    dash = f"http://{cfg.dashboard.host}:{cfg.dashboard.port}/"
    after.append(ChildSpec("dashboard", _argv("dashboard", config_path), ready=lambda: _http_ok(dash)))
    return before, after


def evaluate_now(cfg: StreamRLConfig, label: str) -> dict[str, float]:
    """Held-out greedy and sampled accuracy of what the engines serve now, written to the eval stream."""
    from rollout_fleet.evaluator import run_evaluation_once

    result = asyncio.run(run_evaluation_once(cfg.shared, cfg.rollout, cfg.eval, label))
    print(
        f"streamrl up: held-out accuracy ({label}, version {result['policy_version']:.0f}): "
        f"greedy {result['greedy_accuracy']:.3f}, sampled {result['sampled_accuracy']:.3f}",
        flush=True,
    )
    return result


def run_up(config: StreamRLConfig) -> int:
    started = time.time()
    cfg = prepare(config)
    run_dir = cfg.shared.run_dir
    print(f"streamrl up: run directory {run_dir} (logs in {run_dir / 'logs'})", flush=True)
    sup = Supervisor(run_dir / "logs", grace_s=cfg.up.grace_s)
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
            summary["eval_after"] = evaluate_now(cfg, "after")
    except Exception as exc:  # a start that failed: say which role and why, stop the rest
        log.error("%s", exc)
        print(f"streamrl up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        totals = status.final_totals()  # before Redis stops
        sup.stop_all()
        status.close()
    if sup.failure:
        print(f"streamrl up: stopped because {sup.failure}", file=sys.stderr, flush=True)
    write_summary(cfg, summary, started, totals)
    return code


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
        **totals,
        "wall_seconds": time.time() - started,
        "training_wall_seconds": summary.get("training_wall_seconds"),
        "training_started_at": summary.get("training_started_at"),
        "run_dir": str(cfg.shared.run_dir),
    }
    path = cfg.shared.run_dir / "summary.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("\n" + format_summary(out) + f"\n\nsummary: {path}", flush=True)


def format_summary(s: dict[str, Any]) -> str:
    def pct(x: Any) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    dropped = s.get("samples_dropped_by_reason") or {}
    lines = [
        "streamrl run summary",
        f"  held-out accuracy (greedy): {pct(s['eval_reward_before'])} -> {pct(s['eval_reward_after'])}",
        f"  held-out accuracy (sampled): {pct(s['eval_sampled_before'])} -> {pct(s['eval_sampled_after'])}",
        f"  steps: {s.get('steps')}   policy version: {s.get('policy_version')}",
        f"  samples trained: {s.get('samples_trained')}   dropped: {s.get('samples_dropped')} {dropped}",
        f"  wall time: {s['wall_seconds']:.0f} s",
        f"  run directory: {s['run_dir']}",
    ]
    return "\n".join(lines)
