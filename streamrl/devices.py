"""The device plan: which GPUs every process of a run sees, resolved once from the config and the visible devices.

Roles never pick a GPU themselves. ``up`` resolves the plan before anything starts, prints it, writes it to
``RUN_DIR/devices.json`` and the manifest, and hands each role its ``CUDA_VISIBLE_DEVICES``; inside what it sees
a learner rank takes its local rank (``cuda:LOCAL_RANK``) and an engine starts at its device 0 (SGLang's
``--base-gpu-id 0`` with ``--tp-size``). Roles that need no GPU (Redis, rollout workers, the evaluator, the
archiver, the dashboard, the router) see none, so nothing lands on a learner's GPU by accident.

Placements (``shared.placement``), with G GPUs visible, W = ``learner.world_size`` learner ranks (one GPU each)
and E = ``engine.count`` engines of T GPUs each (``engine.tp_size`` for SGLang, 1 for the built-in engine):

- ``disaggregated``: the learner takes the first W GPUs, engine i the T after the learner's and engine i-1's.
  Needs W + E x T <= G. Weights go by a process-group broadcast (NCCL needs each rank on its own device).
- ``colocated``: engines share the learner's GPUs: engine i on learner GPUs [i x T, (i+1) x T). Needs W <= G,
  T <= W and E x T <= W. Weights go by ``/update_weights_from_tensor`` (CUDA IPC handles), no process group; the
  engines release their memory while the learner trains.

With no GPU (``shared.devices = "cpu"``, or ``auto`` on a machine without one) every process runs on the CPU and
sees no GPU; both placements are valid there (colocated then passes weights through shared memory).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.configlib import ConfigError

if TYPE_CHECKING:
    from streamrl.config import StreamRLConfig

PLACEMENTS = ("disaggregated", "colocated")
# The most of a shared GPU a colocated engine that never releases its memory may take (TRL's colocate mode
# splits a GPU the same way): the learner's weights, gradients, optimizer state and activations need the rest.
COLOCATED_RESIDENT_FRACTION = 0.5
PLAN_FILE = "devices.json"
CPU = "cpu"


def parse_devices(spec: str, detect: Callable[[], list[str]] | None = None) -> list[str]:
    """The GPU ids a run may use, from ``shared.devices``: ``auto`` (the visible GPUs, else none), ``cpu`` (none),
    or a comma-separated list of ids as CUDA_VISIBLE_DEVICES names them ("0,1,2,3", or GPU UUIDs)."""
    text = spec.strip()
    if text == "auto":
        return (detect or visible_gpus)()
    if text.lower() == CPU:
        return []
    ids = [part.strip() for part in text.split(",")]
    if not ids or any(not part for part in ids):
        raise ConfigError(
            f"shared.devices = {spec!r}: expected 'auto', 'cpu' or a comma-separated list of GPU ids like '0,1'"
        )
    if len(set(ids)) != len(ids):
        raise ConfigError(f"shared.devices = {spec!r}: a GPU is named twice")
    return ids


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set (what a scheduler or the user gave us), else
    every GPU torch can count (none on a machine without CUDA)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [part.strip() for part in env.split(",") if part.strip() and part.strip() != "-1"]
    if "torch" not in sys.modules and not Path("/proc/driver/nvidia/version").exists():
        return []  # no NVIDIA driver: no GPU, and the supervisor need not load torch to learn it
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


@dataclass(frozen=True)
class DevicePlan:
    """Where every process of a run runs. GPU ids are the node's (as CUDA_VISIBLE_DEVICES names them)."""

    placement: str
    visible: tuple[str, ...]  # every GPU the run may use; empty: CPU only
    learner: tuple[str, ...]  # learner rank r runs on learner[r]
    engines: tuple[tuple[str, ...], ...]  # engine i's GPUs (its TP group)
    gpus_per_engine: int
    notes: tuple[str, ...] = field(default=())

    @property
    def on_gpu(self) -> bool:
        return bool(self.visible)

    @property
    def used(self) -> tuple[str, ...]:
        """The GPUs some process runs on, in the order of ``visible``."""
        taken = set(self.learner).union(*self.engines) if self.engines else set(self.learner)
        return tuple(g for g in self.visible if g in taken)

    def learner_env(self) -> dict[str, str]:
        """The environment of the learner and each of its ranks (a rank takes ``cuda:LOCAL_RANK`` inside it)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.learner)}

    def engine_env(self, index: int) -> dict[str, str]:
        """The environment of engine ``index``: only its own GPUs (its device 0 is its first)."""
        if not 0 <= index < len(self.engines):
            raise ValueError(f"engine index {index}: the plan has {len(self.engines)} engines")
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.engines[index])}

    @staticmethod
    def no_gpu_env() -> dict[str, str]:
        """The environment of a role that needs no GPU: it sees none."""
        return {"CUDA_VISIBLE_DEVICES": ""}

    def sglang_args(self) -> list[str]:
        """SGLang's own device flags, consistent with :meth:`engine_env`: its first visible GPU, its TP size."""
        return ["--base-gpu-id", "0", "--tp-size", str(self.gpus_per_engine)]

    def to_json(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "device": "cuda" if self.on_gpu else "cpu",
            "visible": list(self.visible),
            "learner": list(self.learner),
            "engines": [list(e) for e in self.engines],
            "gpus_per_engine": self.gpus_per_engine,
            "unused": [g for g in self.visible if g not in self.used],
            "notes": list(self.notes),
        }

    def describe(self) -> list[str]:
        """The plan as the lines ``up`` prints at start."""
        if not self.on_gpu:
            return [
                f"device plan ({self.placement}): CPU only, no GPU visible to any role; "
                f"learner {len(self.learner) or 'its'} rank(s), {len(self.engines)} engine(s)"
            ]
        lines = [f"device plan ({self.placement}): GPUs {','.join(self.visible)}"]
        lines.append(f"  learner: GPUs {','.join(self.learner)} (rank r on the r-th)")
        for i, gpus in enumerate(self.engines):
            lines.append(f"  engine-{i}: GPUs {','.join(gpus)}")
        unused = [g for g in self.visible if g not in self.used]
        if unused:
            lines.append(f"  unused: GPUs {','.join(unused)}")
        lines.append("  every other role: no GPU")
        lines += [f"  note: {n}" for n in self.notes]
        return lines


def resolve_plan(
    devices: Sequence[str],
    placement: str,
    learner_ranks: int,
    engine_count: int,
    gpus_per_engine: int,
) -> DevicePlan:
    """The plan for these GPUs and this shape, or ConfigError naming the fields and the numbers that do not fit."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"shared.placement = {placement!r}: must be one of {PLACEMENTS}")
    visible = tuple(devices)
    if not visible:
        return DevicePlan(placement, (), (), tuple(() for _ in range(engine_count)), gpus_per_engine)
    g, w, e, t = len(visible), learner_ranks, engine_count, gpus_per_engine
    shape = f"learner.world_size = {w}, engine.count = {e}, {t} GPU(s) per engine" + (
        " (engine.tp_size)" if t > 1 else ""
    )
    if placement == "disaggregated":
        if w + e * t > g:
            raise ConfigError(
                f"device plan: disaggregated placement needs learner.world_size + engine.count x GPUs per engine "
                f"= {w} + {e} x {t} = {w + e * t} GPUs, but shared.devices gives {g} ({','.join(visible)}); "
                f"with {shape}: lower them, or set shared.placement = colocated"
            )
        learner = visible[:w]
        engines = tuple(visible[w + i * t : w + (i + 1) * t] for i in range(e))
        return DevicePlan(placement, visible, learner, engines, t)
    if w > g:
        raise ConfigError(
            f"device plan: colocated placement puts one learner rank on each GPU: learner.world_size = {w} "
            f"needs {w} GPUs, but shared.devices gives {g} ({','.join(visible)})"
        )
    if t > w:
        raise ConfigError(
            f"device plan: colocated placement keeps each engine's TP group on the learner's GPUs: "
            f"{t} GPUs per engine (engine.tp_size) > learner.world_size = {w}"
        )
    if e * t > w:
        raise ConfigError(
            f"device plan: colocated placement needs engine.count x GPUs per engine = {e} x {t} = {e * t} "
            f"<= learner.world_size = {w} (one engine shard per learner GPU)"
        )
    learner = visible[:w]
    engines = tuple(learner[i * t : (i + 1) * t] for i in range(e))
    notes = ()
    if e * t < w:
        notes = (f"{w - e * t} learner GPU(s) hold no engine: raise engine.count to use them for rollouts",)
    return DevicePlan(placement, visible, learner, engines, t, notes)


def plan_for(cfg: StreamRLConfig, detect: Callable[[], list[str]] | None = None) -> DevicePlan:
    """The plan of a resolved config: its ``shared.devices`` (``detect`` stands in for the machine's GPUs when
    ``auto``), its placement, learner ranks and engines. Refuses a role that would pick its own GPU."""
    from rollout_fleet.fleet import engine_ranks

    plan = resolve_plan(
        parse_devices(cfg.shared.devices, detect),
        cfg.shared.placement,
        cfg.learner.world_size,
        cfg.engine.count,
        engine_ranks(cfg.engine),
    )
    sync = cfg.weight_sync.for_placement(cfg.shared.placement, cfg.shared.eta)
    if plan.on_gpu and plan.placement == "colocated":
        if sync.transport == "distributed":
            raise ConfigError(
                "weight_sync.transport = 'distributed' with shared.placement = 'colocated' on GPUs: NCCL refuses "
                "two ranks of one group on one GPU; use transport auto or tensor"
            )
        if not sync.release_memory and cfg.engine.mem_fraction_static > COLOCATED_RESIDENT_FRACTION:
            raise ConfigError(
                f"engine.mem_fraction_static = {cfg.engine.mem_fraction_static} with colocated engines that keep "
                f"their memory (weight_sync.release_memory = [], shared.eta = {cfg.shared.eta}): the learner shares "
                f"that GPU; give the engine at most {COLOCATED_RESIDENT_FRACTION} of it, or release memory at eta 0"
            )
    device = cfg.engine.device
    if plan.on_gpu and device.startswith("cuda:") and device != "cuda:0":
        raise ConfigError(
            f"engine.device = {device!r}: under a device plan each engine sees only its own GPUs (its first is "
            "cuda:0); set engine.device = auto or cuda, and shared.devices for which GPUs the run uses"
        )
    return plan


def write_plan(plan: DevicePlan, run_dir: Path) -> Path:
    """RUN_DIR/devices.json: the plan this run's processes were started with."""
    path = Path(run_dir) / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_plan(run_dir: Path) -> dict[str, Any] | None:
    """The plan a run wrote (None when it wrote none)."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())
