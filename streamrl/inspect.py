"""``streamrl inspect RUN_DIR``: read a run's trajectory archive (archiver.archive) and show what was trained.

The run's summary, the reward and each reward component per window of learner steps, the staleness histogram of
the trained samples, and the best, worst and random samples with their components; filters narrow every table,
and ``--export`` writes the selected rows as JSONL. It reads only the run directory (the archive's Parquet
parts, summary.json), never Redis, so it works on a finished run, a live one, or a copy.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from archiver.archive import PENDING_FILE, part_paths, read_archive
from streamrl.summary import GREEDY_AFTER, GREEDY_BEFORE, LAST_GREEDY, LAST_VERSION, read_summary

OUTCOMES = ("trained", "dropped", "dead_lettered", "pending")
# The columns the tables read; --export and the printed samples read every column of the selected rows.
STAT_COLUMNS = ["group_id", "outcome", "outcome_reason", "outcome_step", "reward", "reward_components",
                "staleness_max", "num_tokens", "finish_reason", "reward_status"]  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="streamrl inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("run_dir", type=Path, help="the run directory (its archive/ is read)")
    parser.add_argument("--archive", type=Path, help="the archive directory (default RUN_DIR/archive)")
    parser.add_argument("--steps", help="learner step range A:B (inclusive; either end may be left open)")
    parser.add_argument("--min-reward", type=float, help="keep samples with reward >= this")
    parser.add_argument("--max-reward", type=float, help="keep samples with reward <= this")
    parser.add_argument("--outcome", choices=OUTCOMES, help="keep samples of groups with this outcome")
    parser.add_argument("--reason", help="keep samples dropped or dead-lettered for this reason (e.g. stale)")
    parser.add_argument(
        "--window", type=int, default=0, help="steps per row of the reward table (0: ~10 rows)"
    )
    parser.add_argument("--samples", type=int, default=2, help="best, worst and random samples to print each")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random samples")
    parser.add_argument(
        "--no-pending", action="store_true", help=f"leave out {PENDING_FILE} (undecided groups)"
    )
    parser.add_argument("--export", type=Path, help="write the selected rows, every column, as JSONL here")
    args = parser.parse_args(argv)
    if args.steps is not None:
        args.step_range = _step_range(args.steps, parser)
    else:
        args.step_range = (None, None)
    return args


def _step_range(text: str, parser: argparse.ArgumentParser) -> tuple[int | None, int | None]:
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo) if lo else None, int(hi) if hi else None) if sep else (int(lo), int(lo))
    except ValueError:
        parser.error(f"--steps {text!r}: expected A:B with integers (A:, :B and A also work)")
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        parser.error(f"--steps {text!r}: the range is empty ({bounds[0]} > {bounds[1]})")
    return bounds


def select(table: pa.Table, args: argparse.Namespace) -> pa.Table:
    """The rows that pass every filter of ``args``."""
    keep = pc.is_valid(table.column("outcome"))
    lo, hi = args.step_range
    step = table.column("outcome_step")
    if lo is not None:
        keep = pc.and_(keep, pc.fill_null(pc.greater_equal(step, lo), False))
    if hi is not None:
        keep = pc.and_(keep, pc.fill_null(pc.less_equal(step, hi), False))
    reward = table.column("reward")
    if args.min_reward is not None:
        keep = pc.and_(keep, pc.fill_null(pc.greater_equal(reward, args.min_reward), False))
    if args.max_reward is not None:
        keep = pc.and_(keep, pc.fill_null(pc.less_equal(reward, args.max_reward), False))
    if args.outcome is not None:
        keep = pc.and_(keep, pc.equal(table.column("outcome"), args.outcome))
    if args.reason is not None:
        keep = pc.and_(keep, pc.equal(table.column("outcome_reason"), args.reason))
    return table.filter(keep)


def components(row: dict[str, Any]) -> dict[str, float]:
    return {c["name"]: c["value"] for c in row.get("reward_components") or []}


def reward_windows(rows: list[dict[str, Any]], window: int) -> tuple[list[str], list[list[str]]]:
    """The reward table: per window of learner steps, samples, mean reward and mean of each component."""
    stepped = [r for r in rows if r["outcome_step"] is not None]
    if not stepped:
        return [], []
    first, last = min(r["outcome_step"] for r in stepped), max(r["outcome_step"] for r in stepped)
    width = window or max(1, -(-(last - first + 1) // 10))
    names = sorted({n for r in stepped for n in components(r)})
    buckets: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in stepped:
        buckets[(r["outcome_step"] - first) // width].append(r)
    header = ["steps", "samples", "reward", *names, "tokens", "cut"]
    body = []
    for k in sorted(buckets):
        b = buckets[k]
        lo = first + k * width
        comps = [sum(components(r).get(n, 0.0) for r in b) / len(b) for n in names]
        cut = sum(r["finish_reason"] == "length" for r in b) / len(b)
        body.append([f"{lo}-{lo + width - 1}", str(len(b)), f"{sum(r['reward'] for r in b) / len(b):.3f}",
                     *(f"{c:.3f}" for c in comps), f"{sum(r['num_tokens'] for r in b) / len(b):.0f}",
                     f"{cut:.1%}"])  # fmt: skip
    return header, body


def staleness_histogram(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(staleness, trained samples) for each staleness reached."""
    counts = Counter(
        r["staleness_max"] for r in rows if r["outcome"] == "trained" and r["staleness_max"] is not None
    )
    return sorted(counts.items())


def picked(table: pa.Table, n: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """The best, worst and random ``n`` samples (by reward; rejected entries without samples left out)."""
    with_samples = table.filter(pc.is_valid(table.column("reward")))
    if with_samples.num_rows == 0 or n == 0:
        return {}
    order = pc.sort_indices(with_samples, sort_keys=[("reward", "descending"), ("group_id", "ascending")])
    best = with_samples.take(order[:n]).to_pylist()
    worst = with_samples.take(order[-n:][::-1]).to_pylist()
    chosen = random.Random(seed).sample(range(with_samples.num_rows), min(n, with_samples.num_rows))
    return {"best": best, "worst": worst, "random": with_samples.take(chosen).to_pylist()}


def _sample_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title, show_lines=True, expand=True)
    for col in ("group / sample", "outcome", "reward", "components", "prompt", "completion"):
        table.add_column(col, overflow="fold")
    for r in rows:
        outcome = r["outcome"] + (f" ({r['outcome_reason']})" if r["outcome_reason"] else "")
        if r["outcome_step"] is not None:
            outcome += f" step {r['outcome_step']}"
        if r["staleness_max"] is not None:
            outcome += f" stale {r['staleness_max']}"
        comps = ", ".join(f"{k} {v:g}" for k, v in components(r).items())
        if r["reward_status"] != "ok":
            comps += f" [{r['reward_status']}: {r['reward_error']}]"
        completion = (
            r["completion_text"] if len(r["completion_text"]) <= 600 else r["completion_text"][:600] + " ..."
        )
        table.add_row(f"{r['group_id']} #{r['sample_index']}", outcome, f"{r['reward']:.3f}", comps,
                      r["prompt_text"], f"{completion}\n[dim]{r['num_tokens']} tokens, {r['finish_reason']}[/dim]")  # fmt: skip
    return table


def _summary_table(run_dir: Path, archive: Path, table: pa.Table, selected: int) -> Table:
    out = Table(title=f"run {run_dir}", show_header=False)
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        s = read_summary(summary_path)  # a run directory from before the renames reads the same
        keys = ("steps", "final_policy_version", GREEDY_BEFORE, GREEDY_AFTER, LAST_GREEDY, LAST_VERSION)
        for key in (*keys, "wall_seconds"):
            if s.get(key) is not None:
                out.add_row(key, f"{s[key]:g}" if isinstance(s[key], float) else str(s[key]))
    parts = part_paths(archive)
    nbytes = sum(p.stat().st_size for p in parts)
    groups = len(set(table.column("group_id").to_pylist()))
    out.add_row("archive", f"{archive} ({len(parts)} parts, {nbytes / 2**20:.1f} MiB)")
    out.add_row("samples / groups", f"{table.num_rows} / {groups} ({selected} samples selected)")
    part_rows = sum(
        pq.ParquetFile(p).metadata.num_rows for p in parts
    )  # the pending snapshot is not in nbytes
    if part_rows:
        out.add_row("bytes per sample", f"{nbytes / part_rows:.0f} (in the parts)")
    outcomes = Counter(table.column("outcome").to_pylist())
    reasons = Counter(r for r, o in zip(table.column("outcome_reason").to_pylist(), table.column("outcome").to_pylist(),
                                        strict=True) if o in ("dropped", "dead_lettered"))  # fmt: skip
    out.add_row("outcomes (samples)", ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    if reasons:
        out.add_row("drop reasons (samples)", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    return out


def export_jsonl(table: pa.Table, path: Path) -> int:
    """Write every column of ``table`` as one JSON object per line; returns the rows written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for batch in table.to_batches(max_chunksize=4096):
            for row in batch.to_pylist():
                f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return table.num_rows


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    console = console or Console()
    archive = args.archive or args.run_dir / "archive"
    if not archive.is_dir():
        console.print(f"streamrl inspect: no archive at {archive} (was `archive.enabled` off?)")
        return 2
    table = read_archive(archive, include_pending=not args.no_pending)
    chosen = select(table, args)
    console.print(_summary_table(args.run_dir, archive, table, chosen.num_rows))
    stats = chosen.select(STAT_COLUMNS).to_pylist()
    header, body = reward_windows(stats, args.window)
    if body:
        rewards = Table(title="reward and components by learner step (trained and dropped samples)")
        for col in header:
            rewards.add_column(col, justify="right")
        for row in body:
            rewards.add_row(*row)
        console.print(rewards)
    hist = staleness_histogram(stats)
    if hist:
        top = max(c for _, c in hist)
        stale = Table(title="staleness of the trained samples (versions behind the learner)")
        for col, justify in (("staleness", "right"), ("samples", "right"), ("", "left")):
            stale.add_column(col, justify=justify)
        for value, count in hist:
            stale.add_row(str(value), str(count), "#" * max(1, round(40 * count / top)))
        console.print(stale)
    for title, rows in picked(chosen, args.samples, args.seed).items():
        console.print(_sample_table(f"{title} samples", rows))
    if args.export is not None:
        written = export_jsonl(chosen, args.export)
        console.print(f"exported {written} rows to {args.export}")
    return 0
