"""Durable, atomic checkpoints with torch.distributed.checkpoint, and Hugging Face exports of the policy.

Layout under ``RUN_DIR/checkpoints``::

    step_00000010/            one committed checkpoint (built in step_00000010.tmp, then renamed)
        model_optim/          DCP shards of the model and optimizer
        rng_rank{r}.pt        per-rank RNG states
        meta.json             step, policy version, scheduler state, the consumed ledger, its parent
    step_00000010.1/          a second checkpoint of step 10 (a stop right after one, with new drops to record)
    LATEST                    name of the newest committed checkpoint, for people; never read back

The ledger records which stream entries the checkpoint contains (trained or dropped, keyed by group id), so
after a crash the learner acknowledges exactly those and trains the rest once.

The rename of the ``.tmp`` directory is the one commit point: a checkpoint exists once its directory has its
final name, and the newest such directory (by step, then suffix) is the one a restart loads. Nothing else
decides it, so a crash anywhere in ``save`` leaves either the old newest checkpoint or the new one, never a
pointer that disagrees with the directories (a crash between the rename and a pointer update used to make the
restart load the older checkpoint and train the newer one's groups again). Each checkpoint names its parent, the
checkpoint the run stood on when it was written; :func:`history` follows those links from the newest one, and
that chain's ledgers, not every directory that happens to be on disk, are what the run trained.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from broker.outcomes import Outcome
from common.lifecycle import crash_point
from learner.lora import merged_state_dict

LATEST = "LATEST"
_COMMITTED_NAME = re.compile(r"step_(\d+)(?:\.(\d+))?")


@dataclass
class LedgerEntry:
    """One stream entry whose effect a checkpoint contains."""

    entry_id: str
    group_id: str
    outcome: str  # "trained" or "dropped:<reason>"
    step: int = -1  # the learner step that trained it (or at which it was dropped)
    learner_version: int = -1  # the learner's policy version then
    position: int = -1  # trained: its place among the groups trained at ``step`` (broker.outcomes.Outcome)
    lr: float = -1.0  # trained: the step's learning rate

    def final_outcome(self) -> Outcome | None:
        """The group's durable outcome (broker.outcomes); None for a re-delivery of a group the restored
        checkpoint already contained (its outcome was recorded with that checkpoint)."""
        if self.outcome == "trained":
            return Outcome(
                "trained", self.step, learner_version=self.learner_version, entry_id=self.entry_id,
                position=self.position, lr=self.lr,
            )  # fmt: skip
        reason = self.outcome.split(":", 1)[-1]
        if reason == ALREADY_CONTAINED:
            return None
        return Outcome(
            "dropped", self.step, reason, learner_version=self.learner_version, entry_id=self.entry_id
        )


ALREADY_CONTAINED = "already_contained"  # a ledger line for a group the restored checkpoint contains


@dataclass
class CheckpointMeta:
    step: int
    policy_version: int
    scheduler: dict[str, Any] = field(default_factory=dict)
    ledger: list[LedgerEntry] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    parent: str | None = None  # the checkpoint the run stood on when this one was written (set by save)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CheckpointMeta:
        data = json.loads(text)
        data["ledger"] = [LedgerEntry(**e) for e in data.get("ledger", [])]
        return cls(**data)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_order(path: Path) -> tuple[int, int] | None:
    """``(step, k)`` of a committed checkpoint directory named ``step_<step>`` or ``step_<step>.<k>``; None for
    anything else (a ``.tmp`` directory being written or abandoned, LATEST, a stray file)."""
    match = _COMMITTED_NAME.fullmatch(path.name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def committed_checkpoints(root: Path) -> list[Path]:
    """Every committed checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(order, p) for p in root.iterdir() if (order := checkpoint_order(p)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def history(root: Path) -> list[CheckpointMeta]:
    """The metas of the checkpoints the run stands on, oldest first: the newest committed checkpoint and its
    ancestors (each meta's ``parent``), as far back as pruning left them. A committed checkpoint that is not on
    this chain cannot exist (a restart loads the newest one, whose children are then the run's), but a reader
    never has to rely on that: the run's trained and dropped groups are the union of these ledgers."""
    root = Path(root)
    committed = committed_checkpoints(root)
    chain: list[CheckpointMeta] = []
    current = committed[-1] if committed else None
    while current is not None and (current / "meta.json").is_file():
        meta = CheckpointMeta.from_json((current / "meta.json").read_text())
        chain.append(meta)
        current = root / meta.parent if meta.parent else None
    return chain[::-1]


def trained_group_ids(root: Path) -> list[str]:
    """The group ids the run's checkpoints record as trained, one per training (a group trained twice would
    appear twice), read from :func:`history`."""
    return [e.group_id for meta in history(root) for e in meta.ledger if e.outcome == "trained"]


@dataclass
class PendingCheckpoint:
    """A checkpoint being written (:meth:`CheckpointManager.save_async`): not committed, so not part of the run's
    history, and its ledger's groups not acknowledged, until :meth:`CheckpointManager.finish`."""

    final: Path  # the name it is committed under
    tmp: Path  # where it is written
    meta: CheckpointMeta
    future: Any  # dcp.async_save's future (None for a synchronous save)
    started: float  # time.monotonic() when it was staged

    def written(self) -> bool:
        """This rank's background writes have ended (successfully or not)."""
        return self.future is None or self.future.done()


class CheckpointManager:
    """Save and restore the learner's full state; every rank calls save() and load() together."""

    def __init__(self, root: Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, meta: CheckpointMeta) -> Path:
        """Write a complete checkpoint, committed (and durable) when this returns on every rank.

        Every file is fsynced before the rename, so the renamed directory is whole after a power loss too; the
        ``checkpoint.before_commit`` and ``checkpoint.committed`` crash points (common.lifecycle) sit on either
        side of the rename for the tests that kill the learner there."""
        final, tmp = self._begin(meta)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "model_optim"))
        torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
        return self._commit(PendingCheckpoint(final, tmp, meta, None, time.monotonic()))

    def save_async(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        meta: CheckpointMeta,
        process_group: dist.ProcessGroup | None = None,
    ) -> PendingCheckpoint:
        """Start a checkpoint whose shards are written in the background (``dcp.async_save``): this returns once
        the state is staged (copied to host memory), so training goes on while the files are written; the
        checkpoint is committed, and may be acknowledged, only by :meth:`finish`. ``process_group``: a group of
        its own for the background writer's collectives (a gloo group beside the training one).

        Every rank calls this and later :meth:`finish` together; one checkpoint is in flight at a time (finish
        the previous one first: the next one's parent is the newest committed checkpoint)."""
        final, tmp = self._begin(meta)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        future = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(tmp / "model_optim"),
            process_group=process_group,
        )
        torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
        return PendingCheckpoint(final, tmp, meta, future, time.monotonic())

    def all_written(self, pending: PendingCheckpoint, device: torch.device | None = None) -> bool:
        """Whether every rank's background writes of ``pending`` have ended: each rank's flag, MIN-all-reduced
        over the default (training) group, so every rank gets the same answer and :meth:`finish` together.

        Call it from the thread that runs the training collectives, never over the writer's group: two
        threads' collectives on one group can pair up differently on each rank and deadlock."""
        flag = torch.tensor([1 if pending.written() else 0], device=device or torch.device("cpu"))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def finish(self, pending: PendingCheckpoint) -> Path:
        """Wait for an asynchronous checkpoint's writes (re-raising a failed one) and commit it, as :meth:`save`
        commits: durable and renamed when this returns on every rank."""
        result = pending.future.result() if pending.future is not None else None
        if result is not None and hasattr(result, "upload_completion"):  # newer torch: an AsyncSaveResponse
            result.upload_completion.result()
        crash_point("checkpoint.async_written")
        return self._commit(pending)

    def _begin(self, meta: CheckpointMeta) -> tuple[Path, Path]:
        """Name the next checkpoint and create its ``.tmp`` directory; ``meta.parent`` is the newest committed."""
        parent = self.latest()
        meta.parent = parent.name if parent is not None else None
        name = self._fresh_name(meta.step)
        final, tmp = self.root / name, self.root / f"{name}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        return final, tmp

    def _commit(self, pending: PendingCheckpoint) -> Path:
        """Every rank's files are written: rank 0 fsyncs them, writes meta.json and renames the directory."""
        _barrier()
        if _rank() == 0:
            for child in pending.tmp.rglob("*"):
                if child.is_file():
                    with open(child, "rb+") as fh:
                        os.fsync(fh.fileno())
            _write_durable(pending.tmp / "meta.json", pending.meta.to_json())
            crash_point("checkpoint.before_commit")
            pending.tmp.rename(pending.final)  # the commit point
            _fsync_dir(self.root)
            crash_point("checkpoint.committed")
            _write_durable(self.root / LATEST, pending.final.name)
            self._prune()
        _barrier()
        return pending.final

    def _fresh_name(self, step: int) -> str:
        """``step_<step>``, or ``step_<step>.<k>`` when a checkpoint of that step exists (a stop right after a
        checkpoint, with new drops to record): never overwrite one, its ledger is part of the history."""
        name = f"step_{step:08d}"
        k = 0
        while (self.root / name).exists():
            k += 1
            name = f"step_{step:08d}.{k}"
        return name

    def _prune(self) -> None:
        for old in committed_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale_tmp in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale_tmp, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest committed checkpoint, or None."""
        committed = committed_checkpoints(self.root)
        return committed[-1] if committed else None

    def read_meta(self, path: Path) -> CheckpointMeta:
        return CheckpointMeta.from_json((path / "meta.json").read_text())

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointMeta:
        """Restore model, optimizer and this rank's RNG from ``path``; returns its meta."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "model_optim"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_file = path / f"rng_rank{_rank()}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return self.read_meta(path)


def export_hf(model: nn.Module, source_dir: Path, out_dir: Path) -> Path | None:
    """Save the current policy as a Hugging Face directory (safetensors + config + tokenizer).

    Every rank must call this (the full state dict is gathered); rank 0 writes and returns the path. A model
    with LoRA adapters is written merged (learner.lora.merged_state_dict): engines and the evaluator load it as
    a plain model.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() != 0:
        return None
    return write_hf_dir(merged_state_dict(model, state), _tied(model), source_dir, out_dir)


def write_hf_dir(state: dict[str, torch.Tensor], tied: bool, source_dir: Path, out_dir: Path) -> Path:
    """Write a full (merged) state dict as a Hugging Face directory at ``out_dir``, atomically (built beside it,
    then renamed), with the config and tokenizer files of ``source_dir``; a tied lm-head is left out, as
    ``save_pretrained`` leaves it."""
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.contiguous() for k, v in state.items() if not k.endswith("lm_head.weight") or not tied}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for item in Path(source_dir).iterdir():
        if (
            item.suffix in (".json", ".txt", ".jinja", ".model")
            and item.name != "model.safetensors.index.json"
        ):
            shutil.copy2(item, tmp / item.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


STEP_DIR = re.compile(r"step-(\d+)")  # a snapshot's or an export's directory name: step-NNNNNN


def step_dirs(root: Path, marker: str, source: str | None = None) -> list[Path]:
    """The complete ``step-N`` directories under ``root`` (their ``marker`` file written last, so a directory
    being written is not one), oldest step first; with ``source``, only those whose marker says they were
    written by it (the learner's exports, not the ones ``streamrl export`` made on request)."""
    found = []
    for path in Path(root).glob("step-*"):
        match = STEP_DIR.fullmatch(path.name)
        if match is None or not (path / marker).is_file():
            continue
        if source is None or json.loads((path / marker).read_text()).get("source") == source:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def prune_oldest(paths: list[Path], keep: int, protect: Path | None = None) -> list[Path]:
    """Delete the oldest of ``paths`` (oldest first) so that ``keep`` are left, never ``protect`` (the one just
    written: after a learner's resume it can be of an older step than some left from before); returns them."""
    others = [p for p in paths if p != protect]
    keep_others = keep - 1 if protect in paths else keep
    doomed = others[: max(len(others) - keep_others, 0)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _export_step(export: Path) -> int | None:
    """The step an export directory is of (its export.json), None when it does not say."""
    info = export / "export.json"
    step = json.loads(info.read_text()).get("step") if info.is_file() else None
    return step if isinstance(step, int) else None


def replace_export(new: Path, latest: Path, keep: int) -> None:
    """Make the complete export ``new`` (its export.json written) the ``latest`` one. With ``keep`` above 1 the
    previous latest stays beside it as ``step-N`` (N its step) and the learner's oldest such exports beyond
    ``keep - 1`` are deleted; with 1 (the default) the previous one is replaced, as before there was a choice."""
    if latest.is_dir():
        step = _export_step(latest)
        aside = latest.with_name(f"step-{step:06d}") if step is not None else None
        if keep > 1 and aside is not None and not aside.exists() and step != _export_step(new):
            latest.rename(aside)
        else:
            shutil.rmtree(latest)
    new.rename(latest)
    prune_oldest(step_dirs(latest.parent, "export.json", source="learner"), keep - 1)


def checkpoint_of_step(root: Path, step: int | None) -> Path:
    """The committed checkpoint of ``step`` (the newest one of that step), or the newest of all for None;
    a ValueError names the steps there are."""
    committed = committed_checkpoints(root)
    if not committed:
        raise ValueError(f"{root}: no committed checkpoint")
    if step is None:
        return committed[-1]
    matching = [p for p in committed if checkpoint_order(p)[0] == step]  # type: ignore[index]
    if not matching:
        steps = sorted({checkpoint_order(p)[0] for p in committed})  # type: ignore[index]
        raise ValueError(
            f"step = {step}: no committed checkpoint of that step under {root}; there are {steps}"
        )
    return matching[-1]


def model_state_from_checkpoint(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The policy's full state dict (Hugging Face names, LoRA adapters unmerged) read from a committed
    checkpoint's DCP shards in this process, with no process group: the optimizer state is not read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(Path(checkpoint) / "model_optim"))
    metadata = reader.read_metadata()
    model: dict[str, torch.Tensor] = {}
    for key, info in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(info, TensorStorageMetadata):
            model[key[len("model.") :]] = torch.empty(info.size, dtype=info.properties.dtype)
    state = {"model": model}
    with (
        warnings.catch_warnings()
    ):  # "torch.distributed is ... uninitialized": a single process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def export_checkpoint(checkpoint: Path, source_dir: Path, out_dir: Path, lora: Any = None) -> Path:
    """The Hugging Face directory of a committed checkpoint's policy, built offline (``streamrl export``): the
    model's DCP shards are read in this process, LoRA adapters (``lora``: the run's learner.lora section) are
    merged into their base layers, and the result is written as :func:`export_hf` writes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.loading import parameters_on_meta
    from learner.lora import apply_lora

    state = model_state_from_checkpoint(checkpoint)
    config = AutoConfig.from_pretrained(source_dir)
    with parameters_on_meta():  # the architecture only (LoRA scaling, tied embeddings): no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    if lora is not None and lora.enabled:
        skeleton = apply_lora(skeleton, lora)
    return write_hf_dir(merged_state_dict(skeleton, state), _tied(skeleton), source_dir, out_dir)


def _tied(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False))


SHARED_CHECK_FILE = ".shared-check"  # rank 0's nonce, read back by every rank at start


class CheckpointDirNotShared(RuntimeError):
    """A learner rank does not see the checkpoint directory rank 0 writes: checkpoints would be incomplete."""


def check_shared_directory(path: Path, rank: int, world_size: int) -> None:
    """Every rank of the process group sees the same ``path``: rank 0 writes a fresh nonce file there, every rank
    reads it back, and all learn together whether each one saw it (so no rank is left waiting in a collective).
    Raises :class:`CheckpointDirNotShared` on every rank, naming each rank that did not, when one did not.

    Checkpoints are written by all ranks into one directory (DCP shards, per-rank RNG state) and read back by all
    after a restart, so a rank on a node with its own copy of the path would write checkpoints no one can load.
    """
    import socket
    import uuid

    host = socket.gethostname()
    check = Path(path) / SHARED_CHECK_FILE
    # rank 0's nonce, path and host, which every rank's view is measured against
    origin = [(uuid.uuid4().hex, str(check), host) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(origin, src=0)
    nonce, origin_path, origin_host = origin[0]
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        tmp = check.with_name(f"{SHARED_CHECK_FILE}.tmp")
        tmp.write_text(f"{nonce}\n")
        with open(tmp) as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, check)
    if world_size > 1:
        dist.barrier()
    try:
        seen = check.read_text().strip()
    except OSError as exc:
        seen = f"nothing ({exc.strerror})"
    mine = (rank, host, str(check), seen == nonce, seen)
    views: list[Any] = [mine]
    if world_size > 1:
        views = [None] * world_size
        dist.all_gather_object(views, mine)
    blind = [v for v in views if not v[3]]
    if blind:
        who = "; ".join(f"rank {r} on {h} read {s[:40]!r} from {p}" for r, h, p, _, s in blind)
        raise CheckpointDirNotShared(
            f"the learner's checkpoint directory {Path(origin_path).parent} is not shared by every rank: rank 0 "
            f"on {origin_host} wrote {nonce!r} to {origin_path}, but {who}. Every learner rank must see the "
            "same storage (a shared filesystem mounted at the same path on every node: docs/cluster.md)"
        )
