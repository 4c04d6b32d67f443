"""What the dashboard logs to the run's one wandb run (common.wandb_run): the whole run, read from Redis.

One process writes the run, because two writing one wandb run at once need W&B's shared mode, which needs the
W&B server (no offline mode). The dashboard is that process: it runs for the whole run under ``up`` and
docker-compose, it already reads every role's metrics stream, samples the broker and probes the engines, and
``up`` stops it after its final evaluation and after the learner, the evaluator and the rollout workers (their
last points included). It logs:

- every point of the learner (x-axis ``learner/step``) and of the evaluator and ``up``'s evaluations (x-axis
  ``eval/policy_version``: each held-out accuracy with the version it is of);
- the newest point of every other role's stream (the rollout workers: throughput, staleness, ...) at each poll,
  with the broker sample (backlog, lag, pending) and each engine's probe (running and waiting requests,
  throughput, token usage, weight version), each against its own ``<prefix>/ts`` (unix seconds): a bounded
  number of points over weeks;
- the config tree and the device plan (RUN_DIR/devices.json) as the run's config;
- when it stops, the trajectory archive's parts as an artifact (``archive.wandb_artifact``; ``up`` stops the
  archiver just before the dashboard, so its last part is there).

Where it got to in each stream is kept in RUN_DIR/wandb/streamrl_cursor.json, so a restarted dashboard or
``up --resume`` logs each learner and eval point once.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from archiver.archive import log_artifact
from common.config import SharedConfig
from common.wandb_run import open_run

CURSOR_FILE = "streamrl_cursor.json"
ALL_POINTS = {"learner": "step", "eval": "policy_version"}  # roles logged point by point, and their x-axis

Points = Sequence[tuple[str, Mapping[str, Any]]]  # (stream entry id, values), oldest first


def _numbers(prefix: str, values: Mapping[str, Any]) -> dict[str, float]:
    return {
        f"{prefix}/{k}": float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def safe_name(text: str) -> str:
    """A key part wandb does not split or nest (an engine's host:port)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


class RunLogger:
    """Logs points to an open wandb run (synchronous: the dashboard calls it in a worker thread)."""

    def __init__(self, run: Any, shared: SharedConfig, archive: Path | None = None) -> None:
        self.run = run
        self.shared = shared
        self.archive = archive  # the archive directory whose parts finish() adds as an artifact; None: none
        self.cursor_path = Path(shared.run_dir) / "wandb" / CURSOR_FILE
        try:
            self.cursor: dict[str, str] = json.loads(self.cursor_path.read_text())
        except (OSError, ValueError):
            self.cursor = {}
        self._defined: set[str] = set()

    def since(self, role: str) -> str:
        """The XRANGE start of ``role``'s points not logged yet."""
        return f"({self.cursor[role]}" if role in self.cursor else "-"

    def _define(self, prefix: str, x: str) -> None:
        """``prefix/*`` charted against ``prefix/x`` (each series its own x-axis: a step, a version, a time)."""
        if prefix not in self._defined:
            self.run.define_metric(f"{prefix}/{x}")
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/{x}")
            self._defined.add(prefix)

    def log_points(self, role: str, points: Points) -> None:
        """Log ``points`` of ``role`` (all of them, or the newest for a role not in ALL_POINTS), then move its
        cursor past them."""
        if not points:
            return
        x = ALL_POINTS.get(role, "ts")
        self._define(role, x)
        for _, values in points if role in ALL_POINTS else points[-1:]:
            self.run.log(_numbers(role, values))
        self.cursor[role] = points[-1][0]
        self._save_cursor()

    def log_sample(self, prefix: str, values: Mapping[str, Any]) -> None:
        """One sample (broker, an engine) against ``prefix/ts`` (``values`` carries ``ts``)."""
        self._define(prefix, "ts")
        self.run.log(_numbers(prefix, values))

    def _save_cursor(self) -> None:
        self.cursor_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cursor_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.cursor))
        os.replace(tmp, self.cursor_path)

    def finish(self) -> None:
        """The archive's artifact (when there is an archive), then the run closed."""
        try:
            if self.archive is not None:
                log_artifact(self.run, self.archive, self.shared)
        finally:
            self.run.finish()


def open_logger(
    shared: SharedConfig,
    mode: str,
    config: Mapping[str, Any],
    devices: Any,
    archive: Path | None = None,
) -> RunLogger | None:
    """The run's wandb run opened for the dashboard, with the config tree and the device plan as its config;
    None when wandb is off (``mode`` disabled) or not installed."""
    run = open_run(Path(shared.run_dir), shared.run_id, mode, job_type="run")
    if run is None:
        return None
    run.config.update({"streamrl": dict(config), "devices": devices}, allow_val_change=True)
    return RunLogger(run, shared, archive)
