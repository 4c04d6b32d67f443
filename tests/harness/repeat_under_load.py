"""Run one test many times beside a load like the suite's, and count its failures.

    python -m tests.harness.repeat_under_load \
        tests/test_learner_train.py::test_sigterm_then_kill9_resume_trains_each_group_once \
        --runs 30 --work /tmp/harness --out /tmp/harness/result.json

A test that passes alone and fails inside ``make test`` fails here (issue 34: the exactly-once test failed in the
suite and never beside busy loops). The load is benchmarks.load's SuiteLoad, a slice of the suite in a loop. The
result JSON is rewritten after every run (pass or fail, seconds, the failure's last lines), so a long sitting
that stops early keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.load import ROOT, SuiteLoad


def run_test(node: str, basetemp: Path, timeout_s: float) -> dict:
    """One pytest run of ``node`` in its own temporary directory: passed, seconds, the output's tail."""
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}", node]
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        passed, tail = proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        passed, tail = False, f"harness timeout after {timeout_s} s: {str(exc.stdout or '')[-2000:]}"
    subprocess.run(["rm", "-rf", str(basetemp)], check=False)
    return {"passed": passed, "seconds": round(time.monotonic() - started, 1), "tail": "" if passed else tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.harness.repeat_under_load", description=__doc__.split("\n")[0]
    )
    parser.add_argument("node", help="the pytest node id to repeat")
    parser.add_argument("--runs", type=int, default=30, help="how many runs (default 30)")
    parser.add_argument(
        "--work", type=Path, required=True, help="directory for the runs' and the load's files"
    )
    parser.add_argument("--out", type=Path, required=True, help="result JSON, rewritten after every run")
    parser.add_argument("--no-load", action="store_true", help="run without the load (the quiet baseline)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs = {args.runs}: must be >= 1")
    args.work.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    load = SuiteLoad(args.work / "load")
    if not args.no_load:
        load.__enter__()
    try:
        for i in range(args.runs):
            runs.append(run_test(args.node, args.work / f"run-{i}", args.timeout))
            failures = sum(not r["passed"] for r in runs)
            print(f"run {i + 1}/{args.runs}: {'pass' if runs[-1]['passed'] else 'FAIL'} "
                  f"({runs[-1]['seconds']} s); {failures} failure(s) so far", flush=True)  # fmt: skip
            result = {
                "node": args.node, "load": None if args.no_load else load.stats(), "runs": runs,
                "failures": failures, "completed": len(runs),
            }  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    finally:
        if not args.no_load:
            load.__exit__(None, None, None)
    return 0 if all(r["passed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
