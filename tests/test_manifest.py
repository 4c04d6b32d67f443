"""The run manifest (streamrl.manifest): hashes of files, of a function's source and of the config; the model,
task, dataset and reward records; changed-model and changed-grader detection; ``up``'s start of a manifest and its
refusal of a changed resume on a run directory; the manifest every benchmark result embeds."""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from common.configlib import ConfigError
from rollout_fleet.tasks import available_tasks, task_factory
from streamrl import manifest as m
from streamrl.config import StreamRLConfig


def fake_model(path: Path, weights: bytes = b"weights", tokenizer: str = '{"vocab": 1}') -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text(tokenizer)
    (path / "tokenizer_config.json").write_text("{}")
    (path / "config.json").write_text('{"layers": 2}')
    return path


def config_of(run_dir: Path, model: Path, *overrides: str) -> StreamRLConfig:
    from streamrl.config import load

    return load([f"--shared.run_dir={run_dir}", f"--shared.model_path={model}", *overrides])


# ---- hashes ------------------------------------------------------------------------------------------------
def test_hash_of_a_file_is_the_sha256_of_its_bytes(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc" * 1_000_000)  # several read chunks
    assert m.sha256_file(f) == hashlib.sha256(b"abc" * 1_000_000).hexdigest()


def test_hash_of_a_folder_covers_every_file_by_relative_name(tmp_path: Path) -> None:
    for root in ("a", "b"):
        (tmp_path / root / "sub").mkdir(parents=True)
        (tmp_path / root / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
        (tmp_path / root / "sub" / "part.arrow").write_bytes(b"\x00\x01")
        (tmp_path / root / ".cache").write_text("ignored")
    a, b = m.sha256_tree(tmp_path / "a"), m.sha256_tree(tmp_path / "b")
    assert a["sha256"] == b["sha256"] and set(a["files"]) == {"train.jsonl", "sub/part.arrow"}
    (tmp_path / "b" / "sub" / "part.arrow").write_bytes(b"\x00\x02")
    assert m.sha256_tree(tmp_path / "b")["sha256"] != a["sha256"]


def write_module(tmp_path: Path, name: str, body: str) -> object:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


FN = """
def helper(x):
    return x


def reward(prompt, completion):
    return float(completion.strip() == prompt.answer)
"""


def test_hash_of_a_function_is_the_sha256_of_its_source(tmp_path: Path) -> None:
    one = write_module(tmp_path, "manifest_fn_one", FN)
    info = m.source_info(one.reward)
    source = "def reward(prompt, completion):\n    return float(completion.strip() == prompt.answer)\n"
    assert info["sha256"] == hashlib.sha256(source.encode()).hexdigest()
    assert info["module_sha256"] == m.sha256_file(tmp_path / "manifest_fn_one.py")
    # another helper in the file changes the module's hash, not the function's; an edit of the function both
    two = write_module(tmp_path, "manifest_fn_two", FN.replace("return x", "return -x"))
    assert m.source_info(two.reward)["sha256"] == info["sha256"]
    assert m.source_info(two.reward)["module_sha256"] != info["module_sha256"]
    three = write_module(tmp_path, "manifest_fn_three", FN.replace("prompt.answer", "prompt.answer.lower()"))
    assert m.source_info(three.reward)["sha256"] != info["sha256"]


def test_config_hash_is_stable_under_key_order_and_changes_with_a_value() -> None:
    a = {"learner": {"lr": 1e-5, "steps": 3}, "shared": {"eta": 1, "run_dir": "r"}}
    b = {"shared": {"run_dir": "r", "eta": 1}, "learner": {"steps": 3, "lr": 1e-5}}
    assert m.config_sha256(a) == m.config_sha256(b)
    assert m.config_sha256(a) != m.config_sha256({**b, "shared": {"run_dir": "r", "eta": 2}})
    cfg = StreamRLConfig()
    assert m.config_sha256(cfg) == m.config_sha256(cfg.model_dump(mode="json"))
    changed = cfg.model_copy(deep=True)
    changed.shared.eta = 3
    assert m.config_sha256(changed) != m.config_sha256(cfg)


# ---- records -----------------------------------------------------------------------------------------------
def test_model_record_hashes_weights_and_tokenizer_apart(tmp_path: Path) -> None:
    info = m.model_info(fake_model(tmp_path / "model"))
    assert info["weights_files"] == {"model.safetensors": hashlib.sha256(b"weights").hexdigest()}
    assert set(info["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert set(info["other_files"]) == {"config.json"}
    assert info["weights_sha256"] == m.digest_of(info["weights_files"])
    # the same files elsewhere give the same digests: a copied model is the same model
    copy = m.model_info(fake_model(tmp_path / "copy"))
    assert (copy["weights_sha256"], copy["tokenizer_sha256"]) == (
        info["weights_sha256"],
        info["tokenizer_sha256"],
    )
    assert "note" in m.model_info(tmp_path / "Qwen/not-a-directory")


def test_every_built_in_task_has_a_version() -> None:
    for name in available_tasks():
        info = m.task_info(name, {})
        assert info["version"] and info["version"] == str(task_factory(name).version), name
        assert info["class"].startswith(("rollout_fleet.tasks.", "rollout_fleet.envs."))


def test_reward_record_names_the_custom_function_or_the_task_verifier(tmp_path: Path) -> None:
    write_module(tmp_path, "manifest_fn_reward", FN)
    custom = m.reward_info("manifest_fn_reward:reward", "dataset")
    assert custom["kind"] == "function" and custom["import_path"] == "manifest_fn_reward:reward"
    assert custom["sha256"] == m.source_info(sys.modules["manifest_fn_reward"].reward)["sha256"]
    built_in = m.reward_info(None, "arithmetic")
    assert built_in["kind"] == "task_verifier"
    assert built_in["import_path"] == "rollout_fleet.tasks.arithmetic:ArithmeticTask.score"
    assert built_in["sha256"] == m.source_info(task_factory("arithmetic").score)["sha256"]
    assert m.reward_info("no_such_module_here:fn", "arithmetic")["error"]


def test_run_record_of_a_dataset_run(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = config_of(tmp_path / "run", fake_model(tmp_path / "model"), "--rollout.task.name=dataset",
                    f"--rollout.task.dataset={data}", "--learner.seed=7", "--learner.world_size=3")  # fmt: skip
    record = m.run_record(cfg, argv=["streamrl", "up"])
    assert record["replay"] == {"config_file": "config.toml", "learner_seed": 7, "learner_world_size": 3,
                                "torch_threads": 1}  # fmt: skip
    assert record["datasets"] == {"dataset": {"path": str(data), "sha256": m.sha256_file(data), "bytes": 34}}
    assert m.dataset_files({"system_prompt": "x" * 5000, "instruction": "a\x00b", "dataset": str(data)}) == {
        "dataset": record["datasets"]["dataset"]
    }  # options that are text, not files, are left out
    assert record["task"]["name"] == "dataset" and record["task"]["version"] == "1"
    assert record["reward"]["import_path"] == "rollout_fleet.tasks.dataset:DatasetTask.score"
    assert record["model"]["weights_sha256"] and record["config_sha256"] == m.config_sha256(cfg)
    assert record["code"]["commit"] is None or len(record["code"]["commit"]) == 40
    assert record["packages"]["torch"] and "sglang" in record["packages"]
    assert record["machine"]["cpu_count"] >= 1 and "gpus" in record["machine"]
    json.dumps(record)  # all of it is JSON


def test_cpu_model_and_redis_version_are_read_from_their_sources() -> None:
    assert m.cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n") == (
        "AMD EPYC 9654 96-Core Processor"
    )
    info = {
        "redis_version": "7.2.4",
        "server_name": "valkey",
        "valkey_version": "8.0.1",
        "uptime_in_seconds": 9,
    }
    assert m.redis_server_info(info) == {
        "redis_version": "7.2.4",
        "valkey_version": "8.0.1",
        "server_name": "valkey",
    }


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_git_state_gives_commit_and_dirty_flag_and_says_when_there_is_no_checkout(tmp_path: Path) -> None:
    none = m.git_state(tmp_path)
    assert none["commit"] is None and none["dirty"] is None and "not a git checkout" in none["note"]
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert m.git_state(repo) == {"root": str(repo.resolve()), "commit": git(repo, "rev-parse", "HEAD"),
                                 "dirty": False}  # fmt: skip
    (repo / "new.txt").write_text("untracked files do not count")
    assert m.git_state(repo)["dirty"] is False
    (repo / "a.py").write_text("x = 2\n")
    assert m.git_state(repo)["dirty"] is True
    # a folder inside a checkout is not that checkout (site-packages in a virtualenv in some repository)
    (repo / "site-packages").mkdir()
    assert m.git_state(repo / "site-packages")["commit"] is None


# ---- changes and resumes -----------------------------------------------------------------------------------
def record(tmp_path: Path, name: str = "model", **model: bytes | str) -> dict:
    cfg = config_of(tmp_path / "run", fake_model(tmp_path / name, **model))
    return m.run_record(cfg, argv=["streamrl", "up"], now=1.0)


def test_changed_model_detection_names_what_changed_with_old_and_new_hash(tmp_path: Path) -> None:
    old = record(tmp_path)
    assert m.changes(old, record(tmp_path, "same-model-elsewhere")) == []
    new = record(tmp_path, "retrained", weights=b"other weights")
    [change] = m.changes(old, new)
    assert change.what == "model weights sha256" and change.detail == "files differing: model.safetensors"
    assert (change.old, change.new) == (old["model"]["weights_sha256"], new["model"]["weights_sha256"])
    [change] = m.changes(old, record(tmp_path, "retokenized", tokenizer='{"vocab": 2}'))
    assert change.what == "model tokenizer sha256" and "tokenizer.json" in change.detail


def test_changed_grader_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = record(tmp_path)
    monkeypatch.setattr(task_factory("arithmetic"), "version", "2")
    new = record(tmp_path, "model-2")
    assert [(c.what, c.old, c.new) for c in m.changes(old, new)] == [("task version", "1", "2")]
    new["reward"] = {**new["reward"], "sha256": "f" * 64}
    assert [c.what for c in m.changes(old, new)] == ["task version", "reward function source sha256"]
    # the config, the code and the data may change on a resume (a longer run, a bug fix) without counting
    new = {**old, "config_sha256": "0", "code": {"commit": "1"}, "datasets": {"dataset": {"sha256": "2"}}}
    assert m.changes(old, new) == []


def test_a_resume_is_checked_against_the_latest_record_and_appended(tmp_path: Path) -> None:
    doc = m.new_manifest(record(tmp_path), tmp_path / "run", "run-1")
    changed = record(tmp_path, "retrained", weights=b"other")
    with pytest.raises(m.ChangedRunError) as err:
        m.check_resume(doc, dict(changed), allow=False, manifest_path=tmp_path / "run" / "manifest.json")
    message = str(err.value)
    assert doc["model"]["weights_sha256"] in message and changed["model"]["weights_sha256"] in message
    assert "--up.allow_changed_run=true" in message
    assert len(m.check_resume(doc, changed, allow=True)) == 1 and changed["changes_allowed"] is True
    resumed = m.add_resume(doc, changed)
    assert resumed["resumes"][0]["changed"][0]["what"] == "model weights sha256"
    # the allowed change is the run's model from now on: the next resume with it is not a change
    assert m.check_resume(resumed, record(tmp_path, "retrained-2", weights=b"other"), allow=False) == []
    # the end fills the latest up; the original stays as it was
    done = m.finish(m.with_redis(resumed, {"redis_version": "7.2"}), 0, 12, 13, now=5.0)
    assert done["resumes"][0] | {"ended_at": 5.0, "exit_status": 0, "final_step": 12} == done["resumes"][0]
    assert done["resumes"][0]["redis"] == {"redis_version": "7.2"} and done["redis"] is None
    assert {k: done[k] for k in ("ended_at", "exit_status", "model")} == {
        "ended_at": None, "exit_status": None, "model": doc["model"]}  # fmt: skip


def test_manifest_is_written_atomically(tmp_path: Path) -> None:
    path = tmp_path / "run" / "manifest.json"
    m.write_manifest(path, {"schema_version": 1, "a": 1})
    m.write_manifest(path, {"schema_version": 1, "a": 2})
    assert m.read_manifest(path) == {"schema_version": 1, "a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temporary file left
    assert m.read_manifest(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text('{"schema_version": 1, "a"')
    with pytest.raises(ValueError, match="not a readable manifest"):
        m.read_manifest(tmp_path / "bad.json")


def test_up_refuses_a_resume_of_a_run_dir_whose_model_changed_unless_allowed(tmp_path: Path) -> None:
    from streamrl.up import start_manifest, write_config

    run_dir = tmp_path / "run"
    cfg = config_of(run_dir, fake_model(tmp_path / "model"))
    cfg.shared.run_dir = run_dir
    first = start_manifest(cfg, ["streamrl", "up"])
    assert m.read_manifest(run_dir / "manifest.json") == json.loads(json.dumps(first))
    assert first["resumes"] == [] and first["model"]["weights_sha256"]

    other = config_of(run_dir, fake_model(tmp_path / "model-2", tokenizer='{"vocab": 9}'))
    other.shared.run_dir = run_dir
    with pytest.raises(ConfigError, match="model tokenizer sha256"):
        start_manifest(other)
    assert m.read_manifest(run_dir / "manifest.json")["resumes"] == []  # nothing written on a refusal
    other.up.allow_changed_run = True
    resumed = start_manifest(other)
    assert resumed["resumes"][0]["changes_allowed"] is True and resumed["model"] == first["model"]
    write_config(other)  # the allowance is for this up only: a later resume is checked again
    assert tomllib.loads((run_dir / "config.toml").read_text())["up"]["allow_changed_run"] is False


# ---- benchmarks --------------------------------------------------------------------------------------------
def test_every_benchmark_result_embeds_the_manifest(tmp_path: Path) -> None:
    from benchmarks.common import write_result

    model = fake_model(tmp_path / "model")
    doc = write_result(tmp_path / "r.json", "demo", "quick", {"n": 1}, {"x": 2.0}, {"x": (">=", 1.0)},
                       {"x": 2.0}, model=model)  # fmt: skip
    assert json.loads((tmp_path / "r.json").read_text()) == doc and doc["passed"] is True
    env = doc["manifest"]
    assert set(env) == {"schema_version", "code", "python", "packages", "machine", "model"}
    assert env["code"]["commit"] == m.git_state()["commit"] and env["packages"]["redis"]
    assert env["model"]["weights_sha256"] == m.model_info(model)["weights_sha256"]
    assert "model" not in write_result(tmp_path / "s.json", "demo", "quick", {}, {}, {})["manifest"]
