"""``streamrl replay RUN_DIR [--until STEP] [--from-checkpoint STEP] [--out DIR]``: re-run a run's learner on the
batches it trained, read back from its archive, and compare the weights with its checkpoints.

The run's config (RUN_DIR/config.toml, through the same config tree and validation as the learner) gives the
model, seed, world size, threads and every learner setting; this command spawns ``learner.world_size`` ranks as
``streamrl learner`` does (gloo on CPU), each a :class:`learner.replay.ReplayLearner`, with no Redis. The report
(printed, and written to OUT/replay.json) gives, for every step that has a checkpoint in the run, whether the
replayed weights equal it bit for bit and the largest absolute difference of every tensor.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from common.configlib import ConfigError
from streamrl.config import StreamRLConfig
from streamrl.export import run_config

log = logging.getLogger("streamrl.replay")
REPORT_FILE = "replay.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl replay",
        description="Re-run the learner of a run on the batches it trained (from RUN_DIR's archive: each step's "
        "groups in the order it trained them), with its config, seed and world size, without Redis; then compare "
        "the replayed weights with the run's checkpoint of every step replayed. On the CPU they are equal bit for "
        "bit; on GPUs the report gives the largest difference per tensor. Needs an archive written by a learner "
        "that records each group's position in its batch (older archives are refused).",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (config.toml, checkpoints/, archive/)")
    parser.add_argument(
        "--until", type=int, default=None, help="replay up to this step (default: every step)"
    )
    parser.add_argument(
        "--from-checkpoint",
        type=int,
        default=None,
        metavar="STEP",
        help="start from the run's checkpoint of this step (default: the run's initial weights)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where replay.json goes (default: RUN_DIR/replay)"
    )
    return parser


def _check(config: StreamRLConfig, run_dir: Path, options: argparse.Namespace) -> None:
    """What can be refused before any rank starts: a clear error naming the value."""
    from archiver.batches import check_replayable
    from learner.checkpoint import checkpoint_of_step

    if config.shared.model_path is None:
        raise ConfigError(f"{run_dir}: shared.model_path is not set in the run's config")
    if not Path(config.shared.model_path).is_dir():  # the initial weights (and the architecture) come from it
        raise ConfigError(f"shared.model_path = {str(config.shared.model_path)!r}: no model directory there")
    archive = config.archive.directory(config.shared)
    if not archive.is_dir():
        raise ConfigError(f"archive.dir = {str(archive)!r}: no archive there (was the archiver running?)")
    last = check_replayable(archive)  # NotReplayable (a ValueError): an old archive is refused here
    if options.until is not None and options.until > last:
        raise ConfigError(f"--until {options.until}: the archive's last trained step is {last}")
    if options.from_checkpoint is not None:
        checkpoint_of_step(run_dir / "checkpoints", options.from_checkpoint)  # ValueError naming the steps
        if options.until is not None and options.until < options.from_checkpoint:
            raise ConfigError(
                f"--until {options.until} is before --from-checkpoint {options.from_checkpoint}"
            )


def main(args: list[str]) -> int:
    options = _parser().parse_args(args)
    run_dir = options.run_dir.resolve()
    try:
        config = run_config(run_dir)
        if "RANK" not in os.environ:
            _check(config, run_dir, options)
    except (ConfigError, ValueError) as exc:
        print(f"streamrl replay: {exc}", file=sys.stderr)
        return 2
    out = (options.out or run_dir / "replay").resolve()
    if "RANK" in os.environ:
        return _rank(config, run_dir, options, out)
    from learner.main import spawn_ranks

    print(f"streamrl replay: {config.learner.world_size} rank(s) on {run_dir}", flush=True)
    command = [sys.executable, "-m", "streamrl", "replay", *args]
    code = spawn_ranks(config.learner.world_size, config.learner.grace_s, command)
    if code == 0:
        print(summary(json.loads((out / REPORT_FILE).read_text())))
    return code


def summary(report: dict[str, Any]) -> str:
    """The report as a few lines: one per compared checkpoint, then the verdict."""
    lines = [
        f"step {c['step']} ({c['checkpoint']}): "
        + ("bit-identical" if c["bit_identical"] else f"differs, largest |diff| {c['max_abs_diff']:.3g}")
        for c in report["comparisons"]
    ]
    if not report["comparisons"]:
        lines.append(f"no checkpoint of the steps replayed ({report['steps_replayed']}) to compare with")
    for what in ("code", "torch"):
        run, replay = report[what]["run"], report[what]["replay"]
        if what == "code":
            run, replay = (run or {}).get("commit"), replay.get("commit")
        if run is not None and run != replay:
            lines.append(
                f"the run's {what} was {run}, the replay's is {replay}: differences may come from that"
            )
    recorded = report["run_replay_info"] or {}
    for key, ours in (
        ("learner_world_size", report["world_size"]),
        ("torch_threads", report["torch_threads"]),
    ):
        if recorded.get(key) not in (None, ours):
            lines.append(f"the run's manifest says {key} = {recorded[key]}, the replay ran with {ours}")
    for m in report["lr_mismatches"]:
        lines.append(f"step {m['step']}: lr {m['replayed']!r} replayed, {m['recorded']!r} in the run")
    verdict = "bit-identical to the run" if report["bit_identical"] else "NOT bit-identical to the run"
    lines.append(f"replayed {report['steps_replayed']} step(s): {verdict}; report in {report['report']}")
    return "\n".join(lines)


def _rank(config: StreamRLConfig, run_dir: Path, options: argparse.Namespace, out: Path) -> int:
    """One replay rank (RANK / WORLD_SIZE / MASTER_* from the launcher), as :func:`learner.main.run_rank`."""
    import torch.distributed as dist

    from learner.distributed import init_distributed
    from learner.replay import ReplayLearner

    info = init_distributed(config.learner.pg_timeout_s, config.shared.torch_threads)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s replay[{info.rank}] %(levelname)s: %(message)s"
    )
    learner = ReplayLearner(config.shared, config.broker, config.learner, info)
    code = 0
    try:
        start = _start(learner, run_dir, options.from_checkpoint)
        steps = _archived_steps(config, learner.step, options.until) if info.is_main else None
        comparisons = learner.replay(steps, _checkpoints(run_dir, learner.step))
        if info.is_main:
            _write_report(out, _report(config, run_dir, out, learner, start, comparisons))
    except ValueError as exc:  # the archive cannot give the steps back: every rank learns it from rank 0
        if info.is_main:
            print(f"streamrl replay: {exc}", file=sys.stderr, flush=True)
        code = 2
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as a learner rank: skip the C++ destructors of the store and backend threads


def _start(learner: Any, run_dir: Path, step: int | None) -> str | None:
    """Restore the checkpoint of ``step`` (None: start from the initial weights); its name."""
    from learner.checkpoint import checkpoint_of_step

    if step is None:
        return None
    path = checkpoint_of_step(run_dir / "checkpoints", step)
    learner.restore(path)
    return path.name


def _archived_steps(config: StreamRLConfig, after: int, until: int | None) -> list[Any] | str:
    """Rank 0: the archived steps after ``after`` up to ``until``, or why the archive cannot give them."""
    from archiver.batches import NotReplayable, trained_steps

    try:
        steps = [s for s in trained_steps(config.archive.directory(config.shared), until) if s.step > after]
    except NotReplayable as exc:
        return str(exc)
    if not steps:
        return f"the archive holds no trained step after step {after}" + (f" up to {until}" if until else "")
    if until is not None and steps[-1].step < until:
        return f"--until {until}: the archive's last trained step is {steps[-1].step}"
    return steps


def _checkpoints(run_dir: Path, after: int) -> dict[int, Path]:
    """The run's committed checkpoint of every step after ``after`` (the newest of a step written twice)."""
    from learner.checkpoint import checkpoint_order, committed_checkpoints

    found: dict[int, Path] = {}
    for path in committed_checkpoints(run_dir / "checkpoints"):
        step = checkpoint_order(path)[0]  # type: ignore[index]
        if step > after:
            found[step] = path
    return found


def _report(
    config: StreamRLConfig, run_dir: Path, out: Path, learner: Any, start: str | None, comparisons: list[Any]
) -> dict[str, Any]:
    from dataclasses import asdict

    from streamrl.manifest import MANIFEST_FILE, git_state, package_versions, read_manifest

    manifest = read_manifest(run_dir / MANIFEST_FILE) or {}
    return {
        "run_dir": str(run_dir),
        "report": str(out / REPORT_FILE),
        "world_size": learner.info.world_size,
        "torch_threads": config.shared.torch_threads,
        "start": start or "initial weights",
        "steps_replayed": len(learner.replayed),
        "last_step": learner.step,
        "bit_identical": bool(comparisons) and all(c.bit_identical for c in comparisons),
        "max_abs_diff": max((c.max_abs_diff for c in comparisons), default=None),
        "comparisons": [asdict(c) for c in comparisons],
        "lr_mismatches": learner.lr_mismatches,
        "steps": learner.step_log,
        "run_replay_info": manifest.get("replay"),  # the manifest's record of seed, world size, threads
        "code": {"replay": git_state(), "run": manifest.get("code")},
        "torch": {
            "replay": package_versions(["torch"])["torch"],
            "run": (manifest.get("packages") or {}).get("torch"),
        },
    }


def _write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1, default=str) + "\n")
