"""Engine decode step: fused q/k/v and gate/up projections against the HF modules' separate ones.

The built-in engine's :class:`~rollout_fleet.engine.runner.ModelRunner` runs each decoder layer's q, k and v
projections as one matrix product, and gate and up as another (``fuse_projections=True``, the engine's way);
the baseline is the same runner calling the five HF projection modules one by one (``fuse_projections=False``).
Both decode the same tokens over the same KV cache contents, on one CPU thread, with the project's tiny model
(its shape is the rollout engines' in ``streamrl up``). The two alternate, repeat by repeat, so both see the same
load. Reported per batch size: milliseconds per decode step (median over repeats), the speed-up (baseline /
fused), and the largest logit difference between them (the same function, so float rounding only).

    python -m benchmarks.engine_decode --quick --out runs/engine_decode.json
    python -m benchmarks.engine_decode --out benchmarks/results/engine_decode.json
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from rollout_fleet.engine.runner import ModelRunner, PrefillChunk
from rollout_fleet.model import init_tiny_model

TARGETS = {"decode_speedup": (">=", 1.0)}
MODES = {
    "smoke": {"batches": [2], "steps": 2, "repeats": 1},
    "quick": {"batches": [16, 128], "steps": 30, "repeats": 3},
    "full": {"batches": [16, 64, 128], "steps": 200, "repeats": 7},
}
CONTEXT = 64  # KV length each row decodes at: about a GRPO prompt plus half of a 96-token answer


def time_decode(runner: ModelRunner, batch: int, steps: int) -> tuple[float, torch.Tensor]:
    """Fill ``batch`` sequences' KV blocks with the same prompts, then time ``steps`` decode steps;
    (ms per step, logits)."""
    gen = torch.Generator().manual_seed(batch)
    seqs = [torch.randint(5, 90, (CONTEXT,), generator=gen).tolist() for _ in range(batch)]
    blocks = runner.cache.allocator.blocks_for(CONTEXT + 1)
    tables = [runner.cache.allocate(blocks) or [] for _ in range(batch)]
    runner.prefill([PrefillChunk(t, s, 0, CONTEXT, [CONTEXT - 1]) for t, s in zip(tables, seqs, strict=True)])
    tokens = torch.randint(5, 90, (batch,), generator=gen)
    positions = torch.full((batch,), CONTEXT, dtype=torch.long) - torch.arange(batch) % 7  # ragged lengths
    logits = runner.decode(tokens, positions, tables)  # warm-up, and the output compared across the two
    started = time.perf_counter()
    for _ in range(steps):
        runner.decode(tokens, positions, tables)
    elapsed = (time.perf_counter() - started) / steps * 1e3
    for table in tables:
        runner.cache.allocator.release(table)
    return elapsed, logits


def run(mode: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    cfg = MODES[mode]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(init_tiny_model(), torch_dtype=torch.float32).eval()
    pool = max(cfg["batches"]) * 2 * CONTEXT  # KV tokens: every row's blocks fit
    runners = {
        "separate": ModelRunner(
            copy.deepcopy(model), max_context_len=2 * CONTEXT, max_total_tokens=pool, fuse_projections=False
        ),
        "fused": ModelRunner(model, max_context_len=2 * CONTEXT, max_total_tokens=pool),
    }
    ms: dict[str, dict[int, list[float]]] = {name: {b: [] for b in cfg["batches"]} for name in runners}
    diff: dict[int, float] = {}
    for batch in cfg["batches"]:
        for _ in range(cfg["repeats"]):
            outputs = {}
            for name, runner in runners.items():
                elapsed, outputs[name] = time_decode(runner, batch, cfg["steps"])
                ms[name][batch].append(elapsed)
            diff[batch] = float((outputs["fused"] - outputs["separate"]).abs().max())
    median = {name: {b: statistics.median(v) for b, v in per.items()} for name, per in ms.items()}
    speedup = {b: median["separate"][b] / median["fused"][b] for b in cfg["batches"]}
    params = {
        **cfg,
        "context": CONTEXT,
        "model": "tiny Qwen2 (rollout_fleet.model.init_tiny_model, ~0.87M parameters, fp32)",
        "torch_threads": 1,
        "statistic": "median over repeats, the two ways alternating",
    }
    results = {"ms_per_step": median, "ms_per_step_repeats": ms, "speedup": speedup, "max_logit_diff": diff}
    headline = {
        # the geometric mean over batch sizes: one number that weighs each size alike
        "decode_speedup": math.exp(statistics.fmean(math.log(s) for s in speedup.values())),
        "max_logit_diff": max(diff.values()),
    }
    return params, results, headline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_mode_flags(parser, "two batch sizes, fewer steps (seconds)")
    parser.add_argument("--out", type=Path, default=Path("runs/engine_decode.json"), help="result JSON")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    params, results, headline = run(mode)
    doc = write_result(args.out, "engine_decode", mode, params, results, TARGETS, headline)
    med = results["ms_per_step"]
    rows = [
        [b, med["separate"][b], med["fused"][b], results["speedup"][b], results["max_logit_diff"][b]]
        for b in params["batches"]
    ]
    print(format_table(["rows", "separate ms", "fused ms", "speed-up", "max logit diff"], rows))
    print(f"decode_speedup {doc['decode_speedup']:.3f} (target >= 1), passed={doc['passed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
