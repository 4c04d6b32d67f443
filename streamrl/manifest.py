"""The run manifest: ``RUN_DIR/manifest.json``, what produced a run, so that runs can be compared and a resume
that would mix two models or two graders is refused.

``streamrl up`` writes it at the start and completes it at the end (end time, exit status, final step and
policy version). It holds the code (git commit and dirty flag of the streamrl source tree; ``commit`` null with
a ``note`` outside a git checkout), Python and package versions, the Redis server's version (``INFO server``),
the model directory with the SHA-256 of every weight and tokenizer file, the task with its version, the dataset
files with their SHA-256, the reward function's import path with the SHA-256 of its source, the SHA-256 of the
resolved config (canonical JSON), what a replay of the run needs (:func:`replay_info`: seed, world size, threads)
and the machine (CPU model and count, memory, GPUs through ``torch.cuda``).

A resume (any later ``up`` of the same run directory) appends an entry to ``resumes`` with what it found then,
and never rewrites the original. Before it starts anything, :func:`changes` compares the model (weights and
tokenizer hashes) and the grader (task name and version, reward function import path and source hash) with the
latest entry; a change is refused (:func:`check_resume`) unless ``up.allow_changed_run`` is set, and recorded in
the entry either way.

Everything here but :func:`write_manifest` is a pure function of its arguments and the files it reads; nothing
imports torch unless an NVIDIA driver is present (to list GPUs). Benchmarks embed :func:`environment`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) holding streamrl/
PACKAGES = (
    "streamrl", "torch", "transformers", "sglang", "redis", "pyarrow", "peft", "datasets", "safetensors",
    "numpy", "pydantic",
)  # fmt: skip
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".safetensors.index.json",
    ".bin.index.json",
)
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
        "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja",
        "chat_template.json",
    }
)  # fmt: skip
_CHUNK = 1 << 20


# ---- hashes ------------------------------------------------------------------------------------------------
def sha256_file(path: Path | str) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_of(files: Mapping[str, str]) -> str:
    """One SHA-256 for a set of files: over the sorted ``name sha256`` lines (names relative, so the same files
    in another directory give the same digest)."""
    return hashlib.sha256("".join(f"{k} {files[k]}\n" for k in sorted(files)).encode()).hexdigest()


def sha256_tree(path: Path | str) -> dict[str, Any]:
    """A file's SHA-256, or every file under a directory (recursively, hidden ones skipped) with one digest."""
    path = Path(path)
    if path.is_file():
        sha = sha256_file(path)
        return {"path": str(path), "sha256": sha, "bytes": path.stat().st_size}
    files: dict[str, str] = {}
    size = 0
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            files[rel.as_posix()] = sha256_file(p)
            size += p.stat().st_size
    return {"path": str(path), "sha256": digest_of(files), "bytes": size, "files": files}


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no spaces: the same data gives the same text whatever the key order."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def config_sha256(data: Mapping[str, Any] | Any) -> str:
    """SHA-256 of a resolved config (a pydantic model or its ``model_dump(mode="json")``) as canonical JSON."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()


def source_info(obj: Any) -> dict[str, Any]:
    """The SHA-256 of a function's (or class's) source text, and of the whole file that defines it (which also
    covers the helpers it calls). ``sha256`` is null with a ``note`` when the source cannot be read."""
    target = inspect.unwrap(obj)
    out: dict[str, Any] = {"sha256": None, "module_sha256": None}
    try:
        out["sha256"] = hashlib.sha256(inspect.getsource(target).encode()).hexdigest()
    except (OSError, TypeError) as exc:
        out["note"] = f"no source ({exc})"
    with contextlib.suppress(OSError, TypeError):
        out["source_file"] = inspect.getsourcefile(target)
        if out["source_file"]:
            out["module_sha256"] = sha256_file(out["source_file"])
    return out


# ---- code, packages, machine -------------------------------------------------------------------------------
def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def git_state(root: Path | str = SOURCE_ROOT) -> dict[str, Any]:
    """The git commit of the source tree at ``root`` and whether tracked files differ from it (``dirty``).
    Outside a git checkout of that very tree (an installed package, a tarball), commit and dirty are null and
    ``note`` says so."""
    root = Path(root).resolve()
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel")).resolve()
        if top != root:  # e.g. site-packages inside a virtualenv that sits in some other checkout
            raise ValueError(f"{root} is not the top of a git checkout (that is {top})")
        commit = _git(root, "rev-parse", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        note = getattr(exc, "stderr", None) or str(exc)
        return {
            "root": str(root),
            "commit": None,
            "dirty": None,
            "note": f"not a git checkout: {note.strip()}",
        }
    return {"root": str(root), "commit": commit, "dirty": bool(dirty)}


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    """Installed distribution versions (null: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def python_info() -> dict[str, str]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (text passed in for tests), else the platform's word for it."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith(("model name", "Model", "cpu model")) and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any]:
    """GPU models and counts through ``torch.cuda``. torch is imported only where an NVIDIA driver is present
    (``/proc/driver/nvidia``) or torch is already loaded, so a CPU machine's supervisor stays light."""
    if "torch" not in sys.modules and not Path("/proc/driver/nvidia/version").exists():
        return {"count": 0, "models": {}, "note": "no NVIDIA driver"}
    try:
        import torch

        if not torch.cuda.is_available():
            return {"count": 0, "models": {}, "note": "torch.cuda is not available"}
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        memory = [
            round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1) for i in range(len(names))
        ]
    except Exception as exc:  # a broken driver must not stop a run
        return {"count": 0, "models": {}, "note": f"torch.cuda failed: {exc}"}
    models: dict[str, int] = {}
    for name in names:
        models[name] = models.get(name, 0) + 1
    return {"count": len(names), "models": models, "memory_gb": memory, "cuda": torch.version.cuda}


def machine_info() -> dict[str, Any]:
    """CPU model and count, memory, platform, host and GPUs."""
    memory_gb = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    cores = None
    with contextlib.suppress(AttributeError, OSError):
        cores = len(os.sched_getaffinity(0))
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": cores,
        "memory_gb": memory_gb,
        "platform": platform.platform(),
        "hostname": platform.node(),
        "gpus": gpu_info(),
    }


def environment(model_path: Path | str | None = None) -> dict[str, Any]:
    """The parts of a manifest that make sense without a run (what every benchmark result embeds): code,
    Python, packages and machine, plus the model when one is given."""
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "code": git_state(),
        "python": python_info(),
        "packages": package_versions(),
        "machine": machine_info(),
    }
    if model_path is not None:
        out["model"] = model_info(model_path)
    return out


def redis_server_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies the server, from the reply of ``INFO server`` (Redis, or Valkey which says both)."""
    keys = (
        "redis_version",
        "valkey_version",
        "server_name",
        "redis_mode",
        "os",
        "arch_bits",
        "redis_git_sha1",
    )
    return {k: info[k] for k in keys if k in info}


# ---- model, task, data, reward ----------------------------------------------------------------------------
def model_info(path: Path | str) -> dict[str, Any]:
    """The model directory with the SHA-256 of each weight file and tokenizer file (and of the other files at
    its top level, config.json and the like), and one digest per group."""
    path = Path(path)
    if not path.is_dir():
        return {"path": str(path), "note": "not a local directory: nothing hashed"}
    groups: dict[str, dict[str, str]] = {"weights": {}, "tokenizer": {}, "other": {}}
    for p in sorted(path.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        group = (
            "weights"
            if p.name.endswith(WEIGHT_SUFFIXES)
            else "tokenizer"
            if p.name in TOKENIZER_FILES
            else "other"
        )
        groups[group][p.name] = sha256_file(p)
    out: dict[str, Any] = {"path": str(path.resolve())}
    for group, files in groups.items():
        out[f"{group}_sha256"] = digest_of(files) if files else None
        out[f"{group}_files"] = files
    return out


def task_info(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The task: name, class, version (the class attribute ``version``; null for a task without one) and its
    options."""
    from rollout_fleet.tasks import task_factory

    out: dict[str, Any] = {"name": name, "options": dict(options)}
    try:
        factory = task_factory(name)
    except Exception as exc:  # the role will refuse it with its own error; the manifest just says so
        return {**out, "version": None, "error": str(exc)}
    out["class"] = f"{factory.__module__}:{factory.__qualname__}"
    version = getattr(factory, "version", None)
    out["version"] = None if version is None else str(version)
    return out


def dataset_files(options: Mapping[str, Any]) -> dict[str, Any]:
    """Every task option that names a file or folder on disk (the ``dataset`` task's ``dataset`` and
    ``test_dataset``, or any file-backed task's), with its SHA-256."""
    out: dict[str, Any] = {}
    for key, value in sorted(options.items()):
        if not isinstance(value, str | Path) or not str(value):
            continue
        try:
            exists = Path(value).exists()
        except (OSError, ValueError):  # a system prompt is no file name (too long, a NUL byte)
            exists = False
        if exists:
            out[key] = sha256_tree(Path(value).resolve())
    return out


def reward_info(function: str | None, task_name: str) -> dict[str, Any]:
    """The reward: a custom function by import path (``rollout.reward.function``), else the task's built-in
    verifier (its ``score`` method), with the SHA-256 of its source (:func:`source_info`)."""
    from rollout_fleet.tasks import Task, load_object, task_factory

    try:
        if function:
            obj = load_object(function, "reward function")
            kind, path = "function", function
            if isinstance(obj, type) and issubclass(obj, Task):
                obj, kind, path = obj.score, "task_class", f"{function}.score"
        else:
            factory = task_factory(task_name)
            obj = getattr(factory, "score", factory)
            kind, path = "task_verifier", f"{factory.__module__}:{getattr(obj, '__qualname__', task_name)}"
    except Exception as exc:
        return {"import_path": function or task_name, "sha256": None, "error": str(exc)}
    return {"kind": kind, "import_path": path, **source_info(obj)}


# ---- the document ------------------------------------------------------------------------------------------
def run_record(cfg: Any, argv: list[str] | None = None, now: float | None = None) -> dict[str, Any]:
    """Everything that describes one ``up`` of a run (the manifest itself, or one entry of its ``resumes``)
    except the Redis version, which is known once Redis runs (:func:`with_redis`)."""
    task_options = cfg.rollout.task.options()
    record: dict[str, Any] = {
        "started_at": time.time() if now is None else now,
        "argv": list(sys.argv if argv is None else argv),
        **environment(),
        "redis": None,
        "devices": None,
        "model": model_info(cfg.shared.model_path) if cfg.shared.model_path else None,
        "task": task_info(cfg.rollout.task.name, task_options),
        "datasets": dataset_files(task_options),
        "reward": reward_info(cfg.rollout.reward.function, cfg.rollout.task.name),
        "config_sha256": config_sha256(cfg),
        "replay": replay_info(cfg),
        "ended_at": None,
        "exit_status": None,
        "final_step": None,
        "final_policy_version": None,
    }
    extra = {}
    for field, path in (
        ("engine.model_path", cfg.engine.model_path),
        ("rollout.tokenizer_path", cfg.rollout.tokenizer_path),
    ):
        if path is not None and Path(path).resolve() != Path(cfg.shared.model_path or "").resolve():
            extra[field] = model_info(path)
    if extra:
        record["other_models"] = extra
    return record


def replay_info(cfg: Any) -> dict[str, Any]:
    """What ``streamrl replay`` needs beside the code (``code``), torch (``packages``) and the archive: the config
    file it reads (RUN_DIR/config.toml, whose digest is ``config_sha256``), the learner's seed, its world size and
    each rank's torch threads (float sums depend on how the work is split)."""
    return {
        "config_file": "config.toml",
        "learner_seed": cfg.learner.seed,
        "learner_world_size": cfg.learner.world_size,
        "torch_threads": cfg.shared.torch_threads,
    }


def new_manifest(record: Mapping[str, Any], run_dir: Path | str, run_id: str | None = None) -> dict[str, Any]:
    return {"run_dir": str(run_dir), "run_id": run_id, **record, "resumes": []}


def latest(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The record of the latest ``up`` of the run: its last resume, else the manifest itself."""
    resumes = doc.get("resumes") or []
    return resumes[-1] if resumes else doc


@dataclass(frozen=True)
class Change:
    """What changed between two records: ``what`` names it, ``old`` and ``new`` are the hashes or values."""

    what: str
    old: Any
    new: Any
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.what}: {self.old} -> {self.new}" + (f" ({self.detail})" if self.detail else "")


def _file_detail(old: Mapping[str, str] | None, new: Mapping[str, str] | None) -> str:
    old, new = old or {}, new or {}
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "files differing: " + ", ".join(changed) if changed else ""


def _model_changes(label: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[Change]:
    old, new = old or {}, new or {}
    out = []
    for group in ("weights", "tokenizer"):
        a, b = old.get(f"{group}_sha256"), new.get(f"{group}_sha256")
        if a != b:
            detail = _file_detail(old.get(f"{group}_files"), new.get(f"{group}_files"))
            out.append(Change(f"{label} {group} sha256", a, b, detail))
    return out


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The model and grader changes between two run records: weights and tokenizer digests (of the model and of
    any other model directory), task name and version, reward import path and source hash. The model's path,
    the config, the code and the datasets may differ without counting."""
    out = _model_changes("model", old.get("model"), new.get("model"))
    old_other, new_other = old.get("other_models") or {}, new.get("other_models") or {}
    for field in sorted(set(old_other) | set(new_other)):
        out += _model_changes(field, old_other.get(field), new_other.get(field))
    old_task, new_task = old.get("task") or {}, new.get("task") or {}
    for key in ("name", "version"):
        if old_task.get(key) != new_task.get(key):
            out.append(Change(f"task {key}", old_task.get(key), new_task.get(key)))
    old_reward, new_reward = old.get("reward") or {}, new.get("reward") or {}
    for key, what in (("import_path", "reward function"), ("sha256", "reward function source sha256")):
        if old_reward.get(key) != new_reward.get(key):
            out.append(Change(what, old_reward.get(key), new_reward.get(key)))
    return out


class ChangedRunError(ValueError):
    """A resume whose model or grader changed since the run's manifest was written."""


def check_resume(
    doc: Mapping[str, Any], record: dict[str, Any], allow: bool, manifest_path: Path | str = MANIFEST_FILE
) -> list[Change]:
    """Compare a resume's record with the latest record of the manifest; raise :class:`ChangedRunError` naming
    every change (old and new hash) unless ``allow``. The changes are returned, and recorded in ``record``."""
    found = changes(latest(doc), record)
    record["changed"] = [{"what": c.what, "old": c.old, "new": c.new, "detail": c.detail} for c in found]
    record["changes_allowed"] = bool(found) and allow
    if found and not allow:
        lines = "\n".join(f"  {c}" for c in found)
        raise ChangedRunError(
            f"the run in {Path(manifest_path).parent} was made with another model or grader than this resume "
            f"would use ({manifest_path}):\n{lines}\nresume with --up.allow_changed_run=true to go on anyway"
        )
    return found


def add_resume(doc: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the manifest with ``record`` appended to ``resumes``; the original fields stay as they were."""
    out = dict(doc)
    out["resumes"] = [*(doc.get("resumes") or []), dict(record)]
    return out


def _update_latest(doc: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    resumes = list(doc.get("resumes") or [])
    if resumes:
        resumes[-1] = {**resumes[-1], **fields}
        out["resumes"] = resumes
    else:
        out.update(fields)
    return out


def with_redis(doc: Mapping[str, Any], info: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest with the Redis server of the latest ``up`` filled in."""
    return _update_latest(doc, {"redis": redis_server_info(info)})


def with_devices(doc: Mapping[str, Any], plan: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest with the device plan of the latest ``up`` (streamrl.devices) filled in."""
    return _update_latest(doc, {"devices": dict(plan)})


def finish(
    doc: Mapping[str, Any],
    exit_status: int,
    final_step: int | None,
    final_policy_version: int | None,
    now: float | None = None,
) -> dict[str, Any]:
    """The manifest completed at the end of the latest ``up``: end time, exit status, final step and version."""
    return _update_latest(
        doc,
        {
            "ended_at": time.time() if now is None else now,
            "exit_status": exit_status,
            "final_step": final_step,
            "final_policy_version": final_policy_version,
        },
    )


def read_manifest(path: Path | str) -> dict[str, Any] | None:
    """The manifest at ``path``, or None when there is none; ValueError when it is not a manifest."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable manifest ({exc})") from None
    if not isinstance(doc, dict) or "schema_version" not in doc:
        raise ValueError(f"{path}: not a streamrl run manifest (no schema_version)")
    return doc


def write_manifest(path: Path | str, doc: Mapping[str, Any]) -> None:
    """Write atomically: a temporary file in the same directory, flushed, then renamed over the manifest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(doc, indent=2, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
