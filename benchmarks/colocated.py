"""Colocated against disaggregated: seconds per weight update, and seconds per learner step on the built-in task.

    python -m benchmarks.colocated --quick --out runs/colocated.json
    python -m benchmarks.colocated --tiny --out runs/colocated.json   # what tests/test_colocated_bench.py runs
    python -m benchmarks.colocated --out benchmarks/results/colocated.json

Part 1, the update (one run, the same learner model and the same two engine processes, ``benchmarks.mini_engine``,
interleaved and repeated): ``sync_weights`` as the learner runs it, with ``weight_sync.transport = distributed``
(gloo broadcast over the update group: the disaggregated path) and with ``transport = tensor`` (buckets by
shared-memory handle through ``/update_weights_from_tensor``: the colocated path on the CPU; CUDA IPC on a GPU).
Both are the whole protocol (pause, session, buckets, end, continue). After each the engines' weights are
checked bit-identical to the learner's. Reported: the median seconds of each and ``ratio_tensor_vs_distributed``.

Part 2, the step: ``streamrl up`` on the built-in arithmetic task for ``--steps`` steps at eta 0, colocated (the
engines release their KV pool while each step trains and get the weights by handle) and disaggregated (the same
eta, weights by broadcast), each run ``--runs`` times alternately: seconds per step = training wall time / steps,
and ``ratio_colocated_vs_disaggregated``. On 2 CPU cores both modes share the same cores, so this measures the
protocol's cost (sleep, wake, handles), not the memory a GPU would win.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import format_table, write_result
from benchmarks.weight_sync import BASE_MODEL, MODES, TIMEOUT_S, build_learner_model, http_json, start_engines
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import weights_checksum
from weight_sync.sender import WeightSender, sync_weights

TRANSPORTS = ("distributed", "tensor")
# --tiny (the test's mode): a model of ~4 MB, a short run of each placement. quick and full: benchmarks.weight_sync's.
UPDATE_MODES = {**MODES, "tiny": {**MODES["smoke"], "repeats": 3}}
PLACEMENTS = {"colocated": ["--shared.placement=colocated"], "disaggregated": []}


def updates(mode: str, bucket_mb: float) -> dict[str, Any]:
    """Part 1: median seconds of one full update per transport, same model, same engines."""
    torch.set_num_threads(1)
    spec = UPDATE_MODES[mode]
    model_config = {**BASE_MODEL, **spec["model"]}
    procs, urls = start_engines(model_config, 2)
    samples: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    identical: dict[str, bool] = {}
    try:
        model = build_learner_model(model_config)
        learner_sum = weights_checksum([(n, p.full_tensor()) for n, p in model.named_parameters()])
        senders = {
            t: WeightSender(urls, WeightSyncConfig(transport=t, bucket_mb=bucket_mb, timeout_s=TIMEOUT_S,
                                                   master_address="127.0.0.1"))
            for t in TRANSPORTS
        }  # fmt: skip
        for sender in senders.values():
            sender.connect()
        version = 1
        for repeat in range(spec["repeats"] + 1):  # the first round warms up (allocations, connections)
            for transport, sender in senders.items():
                result = sync_weights(model, version, sender)
                version += 1
                if not result.ok:
                    raise RuntimeError(f"{transport} sync failed: {result.engines_failed}")
                sums = [
                    http_json(u + "/weights_checker", {"action": "checksum"}, TIMEOUT_S)["checksum"]
                    for u in urls
                ]
                identical[transport] = identical.get(transport, True) and all(s == learner_sum for s in sums)
                if repeat:
                    samples[transport].append(result.seconds)
        for sender in senders.values():
            sender.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
    med = {t: statistics.median(v) for t, v in samples.items()}
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "model": model_config,
        "model_bytes": model_bytes,
        "bucket_mb": bucket_mb,
        "samples": samples,
        "median_seconds": med,
        "ratio_tensor_vs_distributed": med["tensor"] / med["distributed"],
        "weights_bit_identical": identical,
    }


def one_up(placement: str, steps: int, model: Path) -> dict[str, float]:
    """One ``streamrl up`` of ``steps`` steps at eta 0 in ``placement``: its seconds per step."""
    with tempfile.TemporaryDirectory(prefix="colocated-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        args = [
            sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={model}",
            "--shared.eta=0", f"--learner.max_steps={steps}", "--learner.wandb_mode=disabled",
            "--dashboard.port=0", "--dashboard.metrics_base_port=0", "--eval.every_versions=0",
            "--eval.heldout_prompts=20", "--archive.enabled=false", *PLACEMENTS[placement],
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"streamrl up ({placement}) failed:\n{proc.stdout[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "seconds_per_step": summary["training_wall_seconds"] / summary["steps"],
        "steps": summary["steps"],
        "wall_seconds": time.monotonic() - started,
        "audit_ok": bool(summary["audit"]["ok"]),
    }


def steps(runs: int, count: int) -> dict[str, Any]:
    """Part 2: seconds per step of each placement, the runs alternating."""
    from streamrl.warm_start import init_warm_model

    model = init_warm_model()
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in PLACEMENTS}
    for i in range(runs):
        for placement in PLACEMENTS:
            samples[placement].append(one_up(placement, count, model))
            print(f"step run {i + 1}/{runs} {placement}: {samples[placement][-1]}", flush=True)
    med = {p: statistics.median(r["seconds_per_step"] for r in rs) for p, rs in samples.items()}
    return {
        "steps_per_run": count,
        "runs": samples,
        "median_seconds_per_step": med,
        "ratio_colocated_vs_disaggregated": med["colocated"] / med["disaggregated"],
        "audit_ok": all(r["audit_ok"] for rs in samples.values() for r in rs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.colocated", description=__doc__.split("\n\n")[0]
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a smaller model, fewer repeats and runs")
    size.add_argument(
        "--tiny", action="store_true", help="a ~4 MB model, one run of 3 steps each (the test's)"
    )
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size of both transports, MiB")
    parser.add_argument("--runs", type=int, default=None, help="up runs per placement (default 3, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps per up run (default 30, quick 10)")
    parser.add_argument("--out", type=Path, default=Path("runs/colocated.json"), help="result JSON")
    args = parser.parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    runs = args.runs or {"tiny": 1, "quick": 1, "full": 3}[mode]
    count = args.steps or {"tiny": 3, "quick": 10, "full": 30}[mode]
    if runs < 1 or count < 1:
        parser.error(f"--runs = {runs}, --steps = {count}: both must be >= 1")
    update = updates(mode, args.bucket_mb)
    if not all(update["weights_bit_identical"].values()):
        raise SystemExit(f"engines' weights differ from the learner's: {update['weights_bit_identical']}")
    step = steps(runs, count)
    headline = {
        "ratio_tensor_vs_distributed": update["ratio_tensor_vs_distributed"],
        "ratio_colocated_vs_disaggregated": step["ratio_colocated_vs_disaggregated"],
    }
    params = {"mode": mode, "engines": 2, "bucket_mb": args.bucket_mb, "runs": runs, "steps": count}
    write_result(args.out, "colocated", mode, params, {"update": update, "step": step}, {}, headline)
    med = update["median_seconds"]
    print(format_table(["update", "seconds"], [[t, med[t]] for t in TRANSPORTS]))
    sps = step["median_seconds_per_step"]
    print(format_table(["placement", "seconds per step"], [[p, sps[p]] for p in PLACEMENTS]))
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
