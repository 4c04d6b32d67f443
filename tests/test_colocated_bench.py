"""benchmarks/colocated.py: the update comparison (the same learner model and engines, weights by gloo broadcast
and by shared-memory handle, each checked bit-identical) on every run of the suite, and the whole benchmark with
its two ``streamrl up`` placements in tiny mode (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


def test_both_transports_update_the_same_engines_bit_identically_and_are_timed(tmp_path: Path) -> None:
    from benchmarks.colocated import TRANSPORTS

    # in a process of its own: the part initialises a one-rank process group (RANK, MASTER_PORT in its
    # environment, a port bound) that must not outlive it in pytest's process, where every later test's
    # subprocess would inherit them (a CI run: 24 later tests' learners failed to bind that MASTER_PORT)
    out = tmp_path / "update.json"
    code = f"import json; from benchmarks.colocated import updates; open({str(out)!r}, 'w').write(json.dumps(updates('tiny', 1.0)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    update = json.loads(out.read_text())
    assert update["weights_bit_identical"] == {t: True for t in TRANSPORTS}
    for transport in TRANSPORTS:
        samples = update["samples"][transport]
        assert len(samples) == 3 and all(s > 0 for s in samples)
    assert update["ratio_tensor_vs_distributed"] == pytest.approx(
        update["median_seconds"]["tensor"] / update["median_seconds"]["distributed"]
    )
    assert update["model_bytes"] > 1_000_000  # more than one 1 MiB bucket: the buckets are exercised


@pytest.mark.slow
def test_the_benchmark_runs_both_placements_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "colocated.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.colocated", "--tiny", "--bucket-mb=1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    step = doc["results"]["step"]
    assert step["audit_ok"] and set(step["median_seconds_per_step"]) == {"colocated", "disaggregated"}
    assert all(r["steps"] == 3 for runs in step["runs"].values() for r in runs)
    assert doc["ratio_colocated_vs_disaggregated"] > 0 and doc["ratio_tensor_vs_distributed"] > 0
