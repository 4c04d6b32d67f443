"""The run's one wandb run: its id, derived from the run directory, and how a process opens it.

One streamrl run is one wandb run, written by one process, the dashboard (streamrl.wandb_log), and resumed
(``resume="allow"``) by it across its restarts and ``up --resume``. W&B's shared mode, the only way for two
processes to write one run at the same time, needs the W&B server (no offline mode). Offline, each opening is a
directory ``RUN_DIR/wandb/offline-run-*-<id>`` of the same id: ``wandb sync --id <id>`` of them uploads them
into that run in order of their start.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("streamrl.wandb")

PROJECT = "streamrl"


def run_id_of(run_dir: Path) -> str:
    """The wandb run id of the run in ``run_dir``: its directory name (W&B-safe characters) and a hash of its
    absolute path, so two runs named alike in different places never share a wandb run."""
    path = str(Path(run_dir).resolve())
    name = re.sub(r"[^A-Za-z0-9_-]", "-", Path(path).name)[:48] or "run"
    return f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:10]}"


def open_run(run_dir: Path, name: str, mode: str, **init: Any) -> Any | None:
    """The run's wandb run, opened (created or resumed) in ``mode`` with its files under ``run_dir``; None when
    ``mode`` is disabled or wandb is not installed."""
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed: nothing is logged to wandb")
        return None
    return wandb.init(
        project=PROJECT,
        id=run_id_of(run_dir),
        name=name,
        dir=str(run_dir),
        mode=mode,
        resume="allow",
        **init,
    )
