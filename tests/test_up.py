"""`streamrl up` end to end on 2 cores: every role as its own process training the warm-started tiny model, every
daemon's Prometheus endpoint scraped, summary.json, then `up --resume` with no sample trained twice; SIGTERM stops
every role cleanly."""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from benchmarks.crash_cost import learner_step
from benchmarks.learning_gain import RUN_ARGS, STEPS
from broker.server import ephemeral_port_range
from common.auth import auth_headers
from common.versioning import answer_version
from common.wandb_run import run_id_of
from learner import checkpoint
from streamrl.config import METRICS_PORT_OFFSETS
from tests.procs import check_run_environments
from tests.prom import scrape
from tests.wandb_records import config, history, run_record

pytestmark = pytest.mark.timeout(1200)
# The held-out greedy gain this run must reach between two fixed versions: the warm start (version 0) and the
# final policy (version STEPS), so the figure does not depend on how many live evaluations a loaded machine fits
# in (the best of those is reported, not asserted). benchmarks/learning_gain.py ran this very configuration
# (RUN_ARGS: the shipped default loss, STEPS = 40 steps, eta 1, 200 held-out problems) beside
# benchmarks.load's SuiteLoad (a slice of the suite in a loop, the machine this test meets inside `make test`) on
# 2026-12-05, on the two warm-model builds seen so far (pinned numerics repeat a build on one machine, not
# across CPU vendors): 10 runs from the Intel Xeon build, 0.510 before
# (benchmarks/results/learning_gain.2026-12-05_loaded_deterministic_warm.json): final gains 0.185 to 0.250, mean
# 0.214, sd 0.025; 8 from the AMD EPYC build, 0.440 before (learning_gain.2026-12-05_loaded_amd_warm.json): 0.185
# to 0.305, mean 0.253, sd 0.040. Pooled (18): mean 0.231, sd 0.037; one more run of a correct system falls below
# the Student t prediction bound 0.092 (normal fit: 0.116) once in a thousand; 0.09 is under both. (The Intel
# runs alone gave 0.103, the bound 0.10 asked before the AMD build was seen.)
# A learner that cannot learn fails it every time: at learning rate ~0 (1e-12) the final gain was 0 in 3 runs of 3
# under the same load (learning_gain_lr0.2026-12-05_loaded.json, the Intel build; the AMD build's colocated run
# likewise, learning_gain_colocated_lr0.2026-12-05_loaded.json); with advantages of the wrong sign (the reward
# inverted) at most -0.380 in 3 of 3 (learning_gain_inverted.json, the earlier warm model).
MIN_FINAL_GAIN = 0.09
ROLES = ["redis", "engine-0", "engine-1", "learner", "rollout-0", "eval", "dashboard"]


def up(run_dir: Path, model: Path, metrics_base: int, *extra: str) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={model}",
        "--dashboard.port=0", f"--dashboard.metrics_base_port={metrics_base}",
        "--eval.samples_per_prompt=2",  # pass@2, not @8: 8 answers a prompt cost ~9 s per evaluation here
        *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def metrics_base_port() -> int:
    """A base for ``dashboard.metrics_base_port`` whose every offset the test scrapes is free, taken below the
    kernel's ephemeral range: a port from that range can be held at any moment by one of the run's own client
    connections, so base + 1 or + 10 may refuse to bind while base itself did."""
    ephemeral_low = ephemeral_port_range()[0]
    span = max(METRICS_PORT_OFFSETS.values()) + 1  # every role's endpoint, one rollout worker
    for _ in range(100):
        # below the 12,000 ports where broker.server.free_port draws the run's server ports
        base = random.randrange(max(1024, ephemeral_low - 24000), ephemeral_low - 12000 - span)
        if all(port_is_free(base + offset) for offset in range(span)):
            return base
    raise RuntimeError(f"no {span} free ports in a row below the ephemeral range ({ephemeral_low})")


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def scrape_every_daemon(run_dir: Path, metrics_base: int) -> dict[str, dict]:
    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    endpoints = {
        "learner": f"http://127.0.0.1:{metrics_base}/metrics",
        "eval": f"http://127.0.0.1:{metrics_base + 1}/metrics",
        "redis": f"http://127.0.0.1:{metrics_base + 2}/metrics",
        "rollout-0": f"http://127.0.0.1:{metrics_base + 10}/metrics",
        "dashboard": f"http://127.0.0.1:{cfg['dashboard']['port']}/metrics",
    }
    for i, url in enumerate(cfg["rollout"]["engine_urls"]):
        endpoints[f"engine-{i}"] = f"{url}/metrics"
    scraped = {}
    for name, url in endpoints.items():
        try:
            scraped[name] = scrape_once_listening(url)
        except urllib.error.URLError as exc:
            raise AssertionError(f"{name}'s metrics endpoint {url} did not answer: {exc.reason}") from exc
    return scraped


def scrape_once_listening(url: str, wait_s: float = 60.0) -> dict:
    """Scrape ``url``, waiting while nothing listens yet: the learner can reach step 3 before a daemon started
    after it (the evaluator, the dashboard) has bound its metrics port on a slow machine."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return scrape(url)
        except urllib.error.URLError as exc:
            if not isinstance(exc.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def assert_archive_complete(run_dir: Path, audit: dict, group_size: int = 8) -> None:
    """Every group that entered the stream is in the run's archive exactly once (a part, or the pending snapshot
    of groups the learner had not decided when the run stopped), and the parts hold every trained sample."""
    from collections import Counter

    from archiver.archive import read_archive

    rows = read_archive(
        run_dir / "archive", include_pending=True, columns=["group_id", "outcome"]
    ).to_pylist()
    per_group = Counter(r["group_id"] for r in rows)
    assert len(per_group) == audit["produced"] and set(per_group.values()) == {group_size}, (
        len(per_group),
        audit,
    )
    trained = sum(r["outcome"] == "trained" for r in rows)
    assert trained == audit["trained"] * group_size, (trained, audit)


def live_evaluations(run_dir: Path) -> int:
    """How many evaluations of a trained policy (version > 0) the run's eval stream holds (0 without Redis)."""
    from broker.metrics import metrics_key
    from common.config import SharedConfig

    url_file = run_dir / "redis" / "url"
    if not url_file.is_file():
        return 0
    try:
        rows = redis.Redis.from_url(url_file.read_text().strip(), socket_timeout=2).xrange(
            metrics_key(SharedConfig(), "eval")
        )
    except redis.RedisError:
        return 0
    return sum(float(fields.get(b"policy_version", 0)) > 0 for _, fields in rows)


def trained_group_ids(run_dir: Path) -> list[str]:
    """What the checkpoints the run stands on record as trained (learner.checkpoint.history)."""
    return checkpoint.trained_group_ids(run_dir / "checkpoints")


def test_roles_that_need_nothing_of_each_other_start_together(tmp_path: Path) -> None:
    """Redis and the engines are one stage (their start-ups overlap); the archiver, a client of Redis, waits for
    it; the learner is a stage of its own; the rollout workers, the evaluator and the dashboard start together."""
    from streamrl.config import StreamRLConfig
    from streamrl.up import child_specs

    cfg = StreamRLConfig.model_validate({"shared": {"run_dir": str(tmp_path)}})
    cfg.rollout.engine_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    before, after = child_specs(cfg, tmp_path / "config.toml")
    assert [[s.name for s in stage] for stage in before] == [["redis", "engine-0", "engine-1"], ["archive"]]
    assert [[s.name for s in stage] for stage in after] == [["learner"], ["rollout-0", "eval", "dashboard"]]


def test_a_fresh_disaggregated_learner_starts_during_the_baseline_evaluation(tmp_path: Path) -> None:
    """It sends no weights to publish version 0, so the evaluation still measures version 0; a learner with a
    checkpoint to resume would send that checkpoint's weights, a colocated one would share the engines' devices."""
    from streamrl.config import StreamRLConfig
    from streamrl.up import learner_starts_during_baseline

    cfg = StreamRLConfig.model_validate({"shared": {"run_dir": str(tmp_path)}})
    assert learner_starts_during_baseline(cfg)
    (tmp_path / "checkpoints").mkdir()
    assert learner_starts_during_baseline(cfg)  # an empty directory: nothing to resume
    (tmp_path / "checkpoints" / "step-00000002").mkdir()
    assert not learner_starts_during_baseline(cfg)
    colocated = StreamRLConfig.model_validate(
        {"shared": {"run_dir": str(tmp_path / "other"), "placement": "colocated"}}
    )
    assert not learner_starts_during_baseline(colocated)


async def test_learner_counts_as_ready_once_version_0_is_published(redis_url: str, tmp_path: Path) -> None:
    """Rollouts wait for this probe: it reads the run's Redis (here an external one, `shared.redis_url`) and turns
    true only when the learner has published a policy version."""
    from broker.client import connect
    from broker.config import BrokerConfig
    from broker.version import PolicyVersion
    from streamrl.config import StreamRLConfig
    from streamrl.up import child_specs

    cfg = StreamRLConfig.model_validate({"shared": {"redis_url": redis_url, "run_dir": str(tmp_path)}})
    cfg.rollout.engine_urls = ["http://127.0.0.1:1"]
    _, after = child_specs(cfg, tmp_path / "config.toml")
    [learner], clients = after  # the rollout workers start only once the learner is ready
    assert (
        learner.name == "learner" and "rollout-0" in [s.name for s in clients] and learner.ready is not None
    )
    assert learner.ready() is False
    client = connect(redis_url)
    await PolicyVersion(client, cfg.shared, BrokerConfig()).publish(0)
    await client.aclose()
    assert learner.ready() is True


def test_up_learns_then_resumes_without_training_twice(tmp_path: Path, warm_model: Path) -> None:
    run_dir = tmp_path / "run"
    metrics_base = metrics_base_port()
    proc = up(run_dir, warm_model, metrics_base, *RUN_ARGS)  # what benchmarks/learning_gain.py measured
    deadline = time.monotonic() + 600
    while learner_step(run_dir) < 3:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the learner never reached step 3"
        time.sleep(0.5)
    scraped = scrape_every_daemon(run_dir, metrics_base)
    assert set(scraped) == set(ROLES) and all(scraped.values())
    assert any(name == "streamrl_learner_step" for name, _ in scraped["learner"])
    assert any(name == "streamrl_engine_weight_version" for name, _ in scraped["engine-0"])
    dashboard_summary = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{tomllib.loads((run_dir / 'config.toml').read_text())['dashboard']['port']}/api/summary",
        timeout=10).read())  # fmt: skip
    assert dashboard_summary  # the page's data source answers for this run
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    # a fresh run: the learner started during the baseline evaluation, which still measured version 0 (below)
    assert out.index("started learner") < out.index("held-out accuracy (before")

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval_greedy_accuracy_before", "eval_greedy_accuracy_after", "steps", "samples_trained", "samples_dropped",
                "wall_seconds"):  # fmt: skip
        assert summary[key] is not None, key
    # versions can run ahead of steps: a learner that crashed (and was restarted) resumes under a fresh version
    assert (
        summary["steps"] == STEPS
        and summary["eval_version_after"] == summary["final_policy_version"] >= STEPS
    )
    assert summary["samples_trained"] == STEPS * 16 * 8  # 16 groups of 8 samples per step by default
    # the archiver's counters as it stopped (every decided group in a part), its CPU time with them
    archived = summary["archive"]
    assert 0 < archived["groups"] + archived["waiting"] <= summary["audit"]["produced"], archived
    assert archived["rows"] == 8 * archived["groups"] and archived["cpu_s"] > 0, archived
    # held-out answers scored with the training reward (the task's verifier here), with pass@k and digit buckets
    assert summary["eval_reward"] == {"source": "training", "scorer": "arithmetic"}
    assert list(summary["eval_pass_at_k_after"]) == ["1", "2"] and "digits=1" in summary["eval_buckets_after"]
    # the final evaluation ran on the trained weights (version STEPS), the first on the warm start (version 0)
    assert summary["eval_version_before"] == 0 and summary["eval_after_is_final_policy"] is True
    # the first rollout request is recorded (benchmarks start their time-to-target clock there)
    assert summary["training_started_at"] < summary["first_request_at"] < summary["training_started_at"] + 600
    # Learning is real. MIN_FINAL_GAIN is sized from the final gain's distribution measured under a suite-like
    # load (see its definition); a learner that cannot learn fails it every time.
    final_gain = summary["eval_greedy_accuracy_after"] - summary["eval_greedy_accuracy_before"]
    assert final_gain >= MIN_FINAL_GAIN, (
        f"held-out greedy {summary['eval_greedy_accuracy_before']} -> best {summary['eval_best_greedy']} "
        f"(version {summary['eval_best_version']}), final {summary['eval_greedy_accuracy_after']}"
    )
    for role in ROLES:
        assert (run_dir / "logs" / f"{role}.log").is_file(), role
    assert (run_dir / "config.toml").is_file() and (
        run_dir / "export" / "latest" / "model.safetensors"
    ).is_file()
    snapshots = sorted((run_dir / "snapshots").glob("step-*"))
    assert [json.loads((p / "snapshot.json").read_text())["step"] for p in snapshots] == [STEPS // 2, STEPS]
    assert all((p / "model.safetensors").is_file() for p in snapshots)
    first = trained_group_ids(run_dir)
    assert len(first) == len(set(first)) == STEPS * 16

    # what produced the run, completed at its end
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["exit_status"], manifest["final_step"], manifest["resumes"]) == (0, STEPS, [])
    assert manifest["redis"]["redis_version"] and manifest["task"]["version"] and manifest["reward"]["sha256"]
    # a resume with another model (its tokenizer file differs by a newline) is refused before anything starts,
    # naming the old and new hash; told to go on, the resume below runs on it
    changed_model = tmp_path / "changed-model"
    shutil.copytree(warm_model, changed_model)
    with open(changed_model / "tokenizer_config.json", "a") as fh:
        fh.write("\n")
    resume = [sys.executable, "-m", "streamrl", "up", "--resume", str(run_dir),
              f"--shared.model_path={changed_model}"]  # fmt: skip
    refused = subprocess.run(resume, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    old_hash = manifest["model"]["tokenizer_sha256"]
    assert (
        f"model tokenizer sha256: {old_hash} -> " in refused.stderr
        and "tokenizer_config.json" in refused.stderr
    )
    assert json.loads((run_dir / "manifest.json").read_text()) == manifest

    # resume the stopped run: it continues from its checkpoint and stream, no group is trained twice
    args = [*resume, f"--learner.max_steps={STEPS + 10}", f"--dashboard.metrics_base_port={metrics_base_port()}",
            "--up.allow_changed_run=true"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    # a resumed learner sends its checkpoint's weights: it starts after the baseline evaluation
    assert out.index("held-out accuracy (before") < out.index("started learner")
    resumed_manifest = json.loads((run_dir / "manifest.json").read_text())
    [entry] = resumed_manifest.pop("resumes")
    assert resumed_manifest == {k: v for k, v in manifest.items() if k != "resumes"}  # the original stays
    assert [c["what"] for c in entry["changed"]] == ["model tokenizer sha256"] and entry["changes_allowed"]
    assert (entry["exit_status"], entry["final_step"]) == (0, STEPS + 10)
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["steps"] == STEPS + 10
    ids = trained_group_ids(run_dir)
    assert len(ids) == len(set(ids)) == (STEPS + 10) * 16
    # the resume cost no more stale drops than the groups that were really in flight at the stop: at most the
    # (eta + 1) steps' worth admission lets be ahead of the learner (before the version lineage, every group
    # waiting in the stream was one version staler after a resume and a third of the next ones were dropped)
    stale = [s["audit"]["dropped_by_reason"].get("stale", 0) for s in (summary, resumed)]
    assert stale[1] - stale[0] <= 2 * 16, stale
    assert resumed["audit"]["lost"] == 0 and resumed["audit"]["trained_twice"] == 0
    assert_archive_complete(
        run_dir, resumed["audit"]
    )  # the groups pending at the stop archived once, on resume


def answered(url: str, key: str | None = None, wait_s: float = 60.0) -> tuple[int, object]:
    """(status, JSON body) of GET ``url`` with the run secret ``key``, waiting while nothing listens yet."""
    request = urllib.request.Request(url, headers=auth_headers(key))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")
        except urllib.error.URLError as exc:
            if not isinstance(exc.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_sigterm_stops_every_role_cleanly(
    tmp_path: Path, warm_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also the device plan on a node of 4 GPUs (named: this machine has none, so every role still computes on
    the CPU): each Python process of every role, the learner's ranks included, really sees the
    GPUs the plan gives its role (read from /proc), and the plan is printed, written and in the manifest. And the
    run's one wandb run (offline): the dashboard logged the evaluations with their versions and the steps."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))  # `up` inherits it: wandb writes under tmp_path
    run_dir = tmp_path / "run"
    # 20 held-out problems, not 200: the evaluation before training is not what this test is of. With the run
    # secret on (common.auth): every role's calls carry it, or the learner never reaches step 2.
    proc = up(
        run_dir, warm_model, metrics_base_port(), "--learner.wandb_mode=offline", "--eval.heldout_prompts=20",
        "--shared.devices=0,1,2,3", "--shared.auth=on", "--eval.every_versions=1",
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while learner_step(run_dir) < 2 or live_evaluations(run_dir) < 1:  # a live evaluation for the summary
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.5)
    seen = check_run_environments(run_dir, learner_ranks=2)
    # Every server requires the secret, and the learner's weight sync carried it (the engines serve a trained
    # version); the rollouts and the evaluation before training did, or step 2 would never come.
    run_cfg = tomllib.loads((run_dir / "config.toml").read_text())
    key = (run_dir / "run_secret").read_text().strip()
    engine_url = run_cfg["rollout"]["engine_urls"][0] + "/model_info"
    dashboard_url = f"http://127.0.0.1:{run_cfg['dashboard']['port']}/api/summary"
    assert [answered(u) for u in (engine_url, dashboard_url)] == [(401, {"error": "Unauthorized"})] * 2
    status, info = answered(engine_url, key)
    assert status == 200 and answer_version(info) >= 1, info
    assert answered(dashboard_url, key)[0] == 200
    assert {"redis", "engine-0", "engine-1", "learner", "rollout-0", "eval", "dashboard"} <= set(seen)
    assert seen["learner"] == {"0,1"} and seen["engine-0"] == {"2"} and seen["engine-1"] == {"3"}
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "device plan (disaggregated): GPUs 0,1,2,3" in out and "engine-1: GPUs 3" in out
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["devices"]["learner"] == ["0", "1"] and manifest["devices"]["engines"] == [["2"], ["3"]]
    for role in ("learner", "rollout-0", "eval", "engine-0", "redis"):
        assert f"stopping {role}" in out
    assert "killing" not in out  # every role drained within its grace period
    assert (run_dir / "checkpoints" / "LATEST").is_file()  # the learner checkpointed on the way out
    # no final evaluation on a stop: the summary shows the last (live) one with its version, and says it is not
    # the final policy's (unless the live evaluator happened to score the final version)
    summary = json.loads((run_dir / "summary.json").read_text())
    last, final = summary["eval_last_version"], summary["final_policy_version"]
    assert summary["eval_greedy_accuracy_after"] is None and last >= 1 and final >= 2, summary
    top = summary["eval_last_version_max"]  # engines updated during the evaluation: its answers span versions
    span = f"v{last:.0f}" if top == last else f"v{last:.0f}-{top:.0f}"
    if summary["eval_last_is_final_policy"]:
        assert last == top == final and f"({span}, last evaluation: the final policy)" in out
    else:
        assert f"({span}, last evaluation; the final policy is v{final}, not evaluated)" in out
    # one wandb run, opened once (by the dashboard), holding every evaluation with its version, the baseline's and
    # the last one's included, beside the learner's steps (the last one too: the dashboard stops after the
    # learner) and the device plan
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1 and run_record(logs[0]).run_id == run_id_of(run_dir), logs
    rows = [row for p in logs for row in history(p)]
    evals = {r["eval/policy_version"]: r["eval/greedy_accuracy"] for r in rows if "eval/policy_version" in r}
    assert (
        evals[0] == summary["eval_greedy_accuracy_before"]
        and evals[last] == summary["eval_last_greedy_accuracy"]
    )
    assert max(r["learner/step"] for r in rows if "learner/step" in r) == summary["steps"]  # the last one too
    assert any(config(p).get("devices", {}).get("engines") == [["2"], ["3"]] for p in logs)
