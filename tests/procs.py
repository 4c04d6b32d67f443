"""What the kernel says about a run's processes: every process under a supervised role, with its real environment
read back from /proc (not what the code meant to pass)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from common.lifecycle import read_records
from streamrl import devices
from streamrl.devices import DevicePlan


@dataclass(frozen=True)
class Proc:
    pid: int
    role: str  # the supervised role it runs under (its own name, or its ancestor's)
    argv: tuple[str, ...]
    env: dict[str, str]


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the fields after the command name: state, ppid, ...


def _read(pid: int) -> tuple[tuple[str, ...], dict[str, str]] | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    env = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
    return tuple(a.decode(errors="replace") for a in argv if a), env


def role_processes(run_dir: Path, processes_file: str = "processes.json") -> list[Proc]:
    """Every live process that descends from (or is) a child ``up`` recorded in RUN_DIR/processes.json."""
    roots = {r.pid: r.name for r in read_records(run_dir / processes_file)}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid, role = int(entry), None
        walk: int | None = pid
        for _ in range(64):  # up the parent chain to a recorded role
            if walk is None or walk <= 1:
                break
            if walk in roots:
                role = roots[walk]
                break
            walk = _parent(walk)
        read = _read(pid) if role is not None else None
        if read is not None:
            found.append(Proc(pid, role, read[0], read[1]))
    return found


def expected_env(plan: DevicePlan, role: str) -> str:
    if role == "learner":
        return plan.learner_env()["CUDA_VISIBLE_DEVICES"]
    if role.startswith("engine-"):
        return plan.engine_env(int(role.split("-")[1]))["CUDA_VISIBLE_DEVICES"]
    return ""


def check_run_environments(run_dir: Path, learner_ranks: int) -> dict[str, set[str]]:
    """Every Python process of a running `up` (roles and their own children: the learner's ranks) has the
    CUDA_VISIBLE_DEVICES its role's plan entry says, read from /proc; learner ranks their local rank. Returns
    the environments seen by role."""
    doc = json.loads((run_dir / devices.PLAN_FILE).read_text())
    plan = DevicePlan(
        doc["placement"], tuple(doc["visible"]), tuple(doc["learner"]),
        tuple(tuple(e) for e in doc["engines"]), doc["gpus_per_engine"],
    )  # fmt: skip
    seen: dict[str, set[str]] = {}
    ranks = []
    for proc in role_processes(run_dir):
        if proc.role == "up":
            continue  # the supervisor itself: it runs no model, and sees what its user gave it
        if "python" not in Path(proc.argv[0]).name:
            continue  # Redis rewrites its process title over the memory /proc/PID/environ shows
        value = proc.env.get("CUDA_VISIBLE_DEVICES")
        assert value == expected_env(plan, proc.role), (proc.role, proc.argv, value)
        seen.setdefault(proc.role, set()).add(value)
        if proc.role == "learner" and "RANK" in proc.env:
            assert proc.env["LOCAL_RANK"] == proc.env["RANK"]  # cuda:LOCAL_RANK inside what it sees
            ranks.append(int(proc.env["RANK"]))
    assert sorted(ranks) == list(range(learner_ranks)), ranks
    return seen
