"""The learner's main loop, run by every rank: intake (rank 0) -> plan -> train step -> publish -> checkpoint.

Rank 0 owns everything that touches Redis, on an asyncio loop in a background thread; the training thread
calls into it with :func:`learner.intake.run_coroutine`. Each step rank 0 scatters every rank its own
micro-batches (token-balanced, equal counts), plus the control decisions (stop, checkpoint now), so all ranks
always agree on what happens next.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from broker.admission import RedisCounters
from broker.client import LEARNER_CLIENT_NAME, connect
from broker.config import BrokerConfig
from broker.consumer import Consumer
from broker.metrics import MetricsWriter
from broker.record import TrajectoryGroup
from broker.staleness import staleness_stats
from broker.version import PolicyVersion
from common.config import SharedConfig
from common.lifecycle import crash_point
from common.versioning import Lineage
from learner.attention import register_packed_attention, resolve_attention_kernel
from learner.checkpoint import (
    CheckpointManager,
    CheckpointMeta,
    LedgerEntry,
    PendingCheckpoint,
    export_hf,
    prune_oldest,
    replace_export,
    step_dirs,
)
from learner.config import LearnerConfig
from learner.distributed import DistInfo, compute_dtype
from learner.intake import (
    Intake,
    NotReady,
    StepBatch,
    group_advantages,
    run_coroutine,
    sequence_limit,
)
from learner.loading import load_sharded
from learner.lora import trainable_parameters
from learner.packing import StepInputs, TrainSequence, step_inputs
from learner.publish import Publication
from learner.schedule import lr_multiplier
from learner.step import RewardPenalty, UpdateInputs, train_batch

log = logging.getLogger("streamrl.learner")


class Publisher(Protocol):
    """Makes new weights visible: every rank calls ``publish`` (rank 0's :class:`Publication` decides whether the
    version is announced); rank 0 asks ``wants_resync`` while it waits for data."""

    def publish(self, model: nn.Module, version: int, initial: bool) -> Publication: ...

    def before_train(self) -> None: ...  # colocated: engines release their memory while a step trains

    def after_train(self, model: nn.Module, version: int) -> None: ...  # a step that published nothing

    def wants_resync(self) -> bool: ...

    def close(self) -> None: ...


@dataclass
class StepPayload:
    """What rank 0 scatters to each rank before a step."""

    stop: bool
    idle: bool = False  # no batch yet: the ranks just loop (keeps collectives inside their timeout)
    resync: bool = False  # idle, and an engine needs the current weights (it came back, or a sync failed)
    updates: list[UpdateInputs] = field(default_factory=list)  # this rank's, one per minibatch
    penalty: RewardPenalty | None = None  # loss.kl_mode = reward: rewards and groups to recompute advantages
    learner_version: int = 0
    checkpoint: bool = False


def build_sequences(
    groups: list[TrajectoryGroup], config: LearnerConfig
) -> tuple[list[TrainSequence], list[float]]:
    """One TrainSequence per sample, with its group-relative advantage; temperatures per sequence."""
    seqs: list[TrainSequence] = []
    temps: list[float] = []
    for group, advantages in zip(groups, group_advantages(groups, config), strict=True):
        for sample, adv in zip(group.samples, advantages.tolist(), strict=True):
            mask = sample.loss_mask.astype("float32")
            if config.loss.mask_truncated and sample.truncated:
                mask = mask * 0
            seqs.append(
                TrainSequence(
                    prompt_ids=torch.from_numpy(group.prompt_ids.astype("int64")),
                    output_ids=torch.from_numpy(sample.output_ids.astype("int64")),
                    logprobs=torch.from_numpy(sample.logprobs.copy()),
                    versions=torch.from_numpy(sample.versions.astype("int64")),
                    loss_mask=torch.from_numpy(mask),
                    advantages=float(adv),
                    index=len(seqs),
                )
            )
            temps.append(sample.temperature if sample.temperature > 1e-6 else 1.0)
    return seqs, temps


def skips_zero_gradient(config: LearnerConfig) -> bool:
    """Whether a step leaves out the samples that carry no gradient: asked for, no reference KL and no entropy
    bonus (whose gradients do not vanish with the advantage)."""
    return config.skip_zero_gradient and config.loss.kl_coef == 0 and config.loss.entropy_coef == 0


def plan_step_inputs(
    seqs: list[TrainSequence], temps: list[float], config: LearnerConfig, world_size: int
) -> StepInputs:
    """A step's per-rank inputs under the learner's config (the trainer's one call of :func:`step_inputs`)."""
    return step_inputs(
        seqs,
        temps,
        world_size,
        config.micro_batch_tokens,
        config.share_prompts,
        config.loss.aggregation,
        skip_zero_gradient=skips_zero_gradient(config),
        varlen=config.varlen,
    )


def minibatch_groups(num_groups: int, minibatches: int) -> list[list[int]]:
    """Group positions of each minibatch: round-robin over the step's groups, which the intake orders oldest
    first, so every minibatch gets old and fresh groups alike."""
    return [list(range(m, num_groups, minibatches)) for m in range(minibatches)]


def plan_updates(
    groups: list[TrajectoryGroup], config: LearnerConfig, world_size: int
) -> tuple[list[list[UpdateInputs]], list[StepInputs], RewardPenalty | None]:
    """The step's updates per rank (``[rank][minibatch]``), the plan of each minibatch, and the reward penalty's
    inputs when the reference KL is a reward penalty."""
    seqs, temps = build_sequences(groups, config)
    sizes = [len(g.samples) for g in groups]
    starts = [0, *accumulate(sizes)][:-1]  # build_sequences lays each group's samples out consecutively
    members = [list(range(start, start + n)) for start, n in zip(starts, sizes, strict=True)]
    plans = []
    for positions in minibatch_groups(len(groups), config.ppo_minibatches):
        subset = [seqs[i] for g in positions for i in members[g]]
        plans.append(plan_step_inputs(subset, temps, config, world_size))
    per_rank = [
        [
            UpdateInputs(
                plan.micro_batches[rank],
                plan.temperatures[rank],
                plan.normaliser,
                trained=any(not mb.is_empty for mbs in plan.micro_batches for mb in mbs),
            )
            for plan in plans
        ]
        for rank in range(world_size)
    ]
    penalty = None
    if config.loss.kl_coef > 0 and config.loss.kl_mode == "reward":
        rewards = [s.reward for g in groups for s in g.samples]
        tokens = [float(s.loss_mask.sum()) for s in seqs]
        penalty = RewardPenalty(rewards=rewards, groups=members, tokens=tokens)
    return per_rank, plans, penalty


def batch_metrics(
    batch: StepBatch, config: LearnerConfig, lineage: Lineage | None = None
) -> dict[str, float]:
    """Reward, advantage and staleness statistics of a step's groups."""
    groups = batch.groups
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    advs = torch.cat(group_advantages(groups, config)).double()
    out: dict[str, float] = {
        "reward_mean": float(rewards.mean()),
        "advantage_mean": float(advs.mean()),
        "advantage_std": float(advs.std()) if len(advs) > 1 else 0.0,
        "samples": float(len(rewards)),
        "output_tokens": float(sum(len(s.output_ids) for g in groups for s in g.samples)),
        "truncated_fraction": float(
            sum(s.truncated for g in groups for s in g.samples) / max(1, len(rewards))
        ),
    }
    components: dict[str, list[float]] = {}
    for g in groups:
        for s in g.samples:
            for name, value in s.reward_components.items():
                components.setdefault(name, []).append(value)
    out.update({f"reward/{k}": sum(v) / len(v) for k, v in components.items()})
    stats = staleness_stats(batch.learner_version, [s.versions for g in groups for s in g.samples], lineage)
    out.update(stats.as_metrics())
    out.update({f"dropped/{k}": float(v) for k, v in batch.dropped.items()})
    return out


class Learner:
    """One rank of the learner. Construct on every rank, then call :meth:`run`."""

    def __init__(
        self,
        shared: SharedConfig,
        broker: BrokerConfig,
        config: LearnerConfig,
        info: DistInfo,
        publisher: Publisher,
        redis_url: str,
    ) -> None:
        self.shared, self.broker_config, self.config, self.info = shared, broker, config, info
        self.publisher = publisher
        self.redis_url = redis_url
        self.stop_requested = threading.Event()
        self.step = 0
        self.version = 0
        self.skipped_steps = 0
        self._skipped = (0, 0)  # the current step's (sequences, tokens) left out: no gradient
        self.checkpoints = CheckpointManager(
            Path(shared.run_dir) / "checkpoints", keep_last=config.keep_checkpoints
        )
        self._pending: PendingCheckpoint | None = None  # being written (learner.async_checkpoint)
        # the background writer's collectives get a gloo group of their own, beside the training group's
        self._checkpoint_group = (
            dist.new_group(backend="gloo") if config.async_checkpoint and dist.is_initialized() else None
        )
        self._last_checkpoint_time = time.monotonic()
        self._checkpointed_step = self.step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._announced: int | None = None  # the last version announced in Redis by this process
        self._unannounced = False  # the last sync did not reach the pool: sync again while idle
        self._last_resync_check = 0.0
        self._last_publish_metrics: dict[str, float] = {}  # the latest sync's, logged with the next step
        self._batch: StepBatch | None = None  # rank 0: the step being trained
        self._batch_started: float | None = None  # rank 0: when it arrived (monotonic)
        self._paced_s = 0.0  # rank 0: how long learner.min_step_interval_s held the current step
        self.model, self.optimizer, self.scheduler = self._build_model()
        self.ref_model = self._build_reference() if config.loss.kl_coef > 0 else None
        # refused here, on every rank, when impossible; rank 0's intake drops groups with longer samples
        model_context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_seq_len = sequence_limit(config.max_seq_len, model_context)

    # ----- setup -------------------------------------------------------------------------------------------

    def _build_model(self) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        if self.shared.model_path is None:
            raise ValueError("shared.model_path is not set: the learner needs a Hugging Face model directory")
        torch.manual_seed(self.config.seed)
        # built on the meta device, sharded, then each rank reads its own shards (learner.loading)
        model, _ = load_sharded(
            Path(self.shared.model_path),
            self.info.device,
            attention=self._attention(),
            lora=self.config.lora,  # adapters injected before sharding: FSDP2 shards the frozen base too
            seed=self.config.seed,
            activation_checkpointing=self.config.activation_checkpointing,
            mixed_precision=self.config.mixed_precision,
        )
        optimizer = torch.optim.AdamW(
            trainable_parameters(model),  # with LoRA, the adapters only
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        config = self.config
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, config))
        return model, optimizer, scheduler

    def _attention(self) -> str:
        """The packed attention implementation ``learner.attention_kernel`` resolves to on this device."""
        dtype = compute_dtype(self.config.mixed_precision, self.info.device)
        name = resolve_attention_kernel(self.config.attention_kernel, self.info.device, dtype)
        log.info("packed attention: %s (learner.attention_kernel = %s)", name, self.config.attention_kernel)
        return register_packed_attention(name)

    def _build_reference(self) -> nn.Module:
        """The frozen reference policy for the KL: the initial weights (shared.model_path), loaded sharded like
        the policy (its shards in host memory with learner.reference_offload), without gradients, never updated
        or checkpointed (it is the model directory)."""
        ref, _ = load_sharded(
            Path(self.shared.model_path),
            self.info.device,
            attention=self._attention(),
            mixed_precision=self.config.mixed_precision,
            offload=self.config.reference_offload,
        )
        ref.requires_grad_(False)
        ref.eval()
        return ref

    def _start_redis_side(self) -> None:
        """Rank 0: an event loop thread owning the Redis client, consumer, version, metrics and admission."""
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="learner-redis", daemon=True).start()

        async def make() -> None:
            client = connect(self.redis_url, self.broker_config, name=LEARNER_CLIENT_NAME)
            self.client = client
            self.consumer = Consumer(client, self.shared, self.broker_config, self.config.consumer_name)
            await self.consumer.ensure_group()
            self.policy_version = PolicyVersion(client, self.shared, self.broker_config)
            self.metrics = MetricsWriter(client, self.shared, "learner")
            self.intake = Intake(
                self.consumer,
                RedisCounters(client, self.shared),
                self.config,
                self.shared.eta,
                self.stop_requested.is_set,
                max_seq_len=self.max_seq_len,
            )

        self._call(make())

    def _call(self, coro, timeout_s: float | None = None):  # noqa: ANN001, ANN202
        assert self._loop is not None
        return run_coroutine(self._loop, coro, timeout_s or self.config.pg_timeout_s)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_requested.set())

    # ----- resume and publication --------------------------------------------------------------------------

    def _resume(self) -> None:
        """Restore the latest checkpoint (if any), acknowledge what it contains, and publish a fresh version."""
        latest = self.checkpoints.latest()
        meta = self.restore(latest) if latest is not None else None
        published = None
        if self.info.is_main:
            published = self._call(self.policy_version.get())
            if meta is not None:
                self.intake.contained = {e.group_id for e in meta.ledger}
                self.intake.totals = dict(meta.extra.get("totals", {}))
                self.intake.sample_totals = dict(meta.extra.get("sample_totals", {}))
                done = self._call(self.intake.acknowledge(meta.ledger))
                log.info("acknowledged %d entries contained in the restored checkpoint", done)
        published = self._broadcast(published)
        if published is None:
            self.version = 0
            self._publish(initial=True)
        else:
            # Versions are never reused: the restored weights get a fresh one, above every published version.
            restored = meta.policy_version if meta else 0
            self.version = max(published, restored) + 1
            if self.info.is_main:
                self._record_resume(restored, published)
            self._publish(initial=False)

    def restore(self, path: Path) -> CheckpointMeta:
        """Load the committed checkpoint at ``path`` (every rank): weights, optimizer, RNG, step and lr schedule."""
        meta = self.checkpoints.load(path, self.model, self.optimizer)
        self.step = self._checkpointed_step = meta.step
        self.scheduler.load_state_dict(meta.scheduler)
        log.info("resumed from %s (step %d, version %d)", path, meta.step, meta.policy_version)
        return meta

    def _record_resume(self, restored: int, published: int) -> None:
        """Rank 0: the fresh version holds the checkpoint's weights (``restored``'s); staleness is measured by
        weights from now on (common.versioning.Lineage), so the resume itself makes no group stale."""
        lineage = self._call(self.policy_version.lineage())
        lineage = lineage.resumed(self.version, restored, published)
        self._call(self.policy_version.record_resume(lineage.points[-1]))
        self.intake.lineage = lineage
        point = lineage.points[-1]
        log.info(
            "version %d holds the weights of version %d (position %d); %d position(s) rolled back",
            self.version, restored, point.position, point.rollback,
        )  # fmt: skip

    def _publish(self, initial: bool) -> None:
        """Sync ``self.version`` to the engines (every rank) and announce it in Redis (rank 0) once the sync says
        it may: a version that reached no engine, or not every engine of the pool, is not announced, and the
        learner syncs again while it waits for data (``_wants_resync``) and at the next step."""
        started = time.monotonic()
        publication = self.publisher.publish(self.model, self.version, initial)
        if not self.info.is_main:
            return
        if publication.announce and self._announced != self.version:
            if initial:
                self._publish_initial()
            else:
                self._call(self.policy_version.publish(self.version))
            self._announced = self.version
            # admission counts in groups: what the announced weights contain (a resume states its checkpoint's)
            self._call(self.intake.counters.set_consumed(self.intake.totals.get("trained", 0)))
        self._unannounced = not publication.announce
        self._last_publish_metrics = {
            **publication.metrics,
            "publish_seconds": time.monotonic() - started,
            "version_announced": float(publication.announce),
        }

    def _publish_initial(self) -> None:
        current = self._call(self.policy_version.get())
        if current is None:
            self._call(self.policy_version.publish(0))

    def _wants_resync(self) -> bool:
        """Rank 0, idle: sync again when the last version was not announced or an engine is back, at most once
        per ``learner.idle_check_s``."""
        now = time.monotonic()
        if now - self._last_resync_check < self.config.idle_check_s:
            return False
        self._last_resync_check = now
        return self._unannounced or self.publisher.wants_resync()

    def _broadcast(self, obj: Any) -> Any:
        if self.info.world_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    # ----- the loop -----------------------------------------------------------------------------------------

    def run(self) -> int:
        if self.info.is_main:
            self._start_redis_side()
        self._resume()
        while True:
            payload = self._next_payload()
            if payload.stop:
                break
            self._poll_checkpoint()  # every rank at the same payload: the poll is a collective
            if payload.idle:
                if payload.resync:
                    self._publish(initial=False)
                continue
            self._train(payload)
            if payload.checkpoint:
                self._checkpoint()
        self._checkpoint(final=True)
        if self.config.export_at_end:
            self._export()
        self.publisher.close()
        return 0

    def _next_payload(self) -> StepPayload:
        if not self.info.is_main:
            return self._scatter(None)
        done = self.config.max_steps and self.step >= self.config.max_steps
        if not done:
            self._pace()
        try:
            wait_slice = min(self.config.idle_check_s, self.config.pg_timeout_s / 4)
            self.intake.step = self.step + 1
            self.intake.lr = float(self.scheduler.get_last_lr()[0])  # recorded with each trained group
            batch = None if done else self._call(self.intake.next_batch(self.version, wait_slice))
        except NotReady:
            resync = self._wants_resync()
            return self._scatter([StepPayload(stop=False, idle=True, resync=resync)] * self.info.world_size)
        if batch is None:
            return self._scatter([StepPayload(stop=True)] * self.info.world_size)
        self._batch = batch
        self._batch_started = time.monotonic()
        return self._scatter(self._payloads(batch))

    def _pace(self) -> None:
        """Hold the next batch until ``learner.min_step_interval_s`` after the previous one arrived: the fleet
        keeps generating meanwhile, as it does ahead of a trainer slower than itself."""
        interval, started = self.config.min_step_interval_s, self._batch_started
        wait = 0.0 if not interval or started is None else started + interval - time.monotonic()
        self._paced_s = max(wait, 0.0)
        if wait > 0:
            self.stop_requested.wait(wait)

    def _payloads(self, batch: StepBatch) -> list[StepPayload]:
        per_rank, plans, penalty = plan_updates(batch.groups, self.config, self.info.world_size)
        self._skipped = (sum(p.skipped for p in plans), sum(p.skipped_tokens for p in plans))
        due = self.step + 1
        checkpoint = due % self.config.checkpoint_every == 0 or (
            time.monotonic() - self._last_checkpoint_time > self.config.checkpoint_interval_s
        )
        return [
            StepPayload(
                stop=False,
                updates=updates,
                penalty=penalty,
                learner_version=batch.learner_version,
                checkpoint=checkpoint,
            )
            for updates in per_rank
        ]

    def _scatter(self, payloads: list[StepPayload] | None) -> StepPayload:
        if self.info.world_size == 1:
            assert payloads is not None
            return payloads[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, payloads, src=0)
        return out[0]

    def _train(self, payload: StepPayload) -> None:
        updates = [u.to(self.info.device) for u in payload.updates]
        self.publisher.before_train()
        published = False
        result = train_batch(
            self.model,
            self.optimizer,
            updates,
            self.config,
            payload.learner_version,
            ref_model=self.ref_model,
            penalty=payload.penalty,
        )
        if not result.applied:
            self.skipped_steps += 1
            log.warning("step skipped: non-finite loss or gradient (grad norm %s)", result.grad_norm)
        else:
            self.scheduler.step()
            self.step += 1
            if self.step % self.config.publish_every == 0:
                self.version += 1
                self._publish(initial=False)
                published = True
            if self.config.snapshot_every and self.step % self.config.snapshot_every == 0:
                self._snapshot()
            if self.config.export_every and self.step % self.config.export_every == 0:
                self._export()
        if not published:
            self.publisher.after_train(self.model, self.version)
        if self.info.is_main:
            self._log_step(result.metrics, result.applied)

    def _log_step(self, train_metrics: dict[str, float], applied: bool) -> None:
        batch, started = self._batch, self._batch_started
        assert batch is not None and started is not None
        wall = time.monotonic() - started + batch.wait_s
        metrics = {
            **train_metrics,
            **batch_metrics(batch, self.config, self.intake.lineage),
            **self._last_publish_metrics,
        }
        tokens = sum(len(g.prompt_ids) * len(g.samples) + g.num_tokens() for g in batch.groups)
        metrics.update(
            step=float(self.step),
            policy_version=float(self.version),
            skipped_steps=float(self.skipped_steps),
            step_applied=float(applied),
            lr=float(self.scheduler.get_last_lr()[0]),
            wait_seconds=batch.wait_s,
            paced_seconds=self._paced_s,
            skipped_samples=float(self._skipped[0]),
            skipped_tokens=float(self._skipped[1]),
            step_seconds=wall,
            idle_ratio=batch.wait_s / wall if wall > 0 else 0.0,
            trained_tokens_per_s=tokens / wall if wall > 0 else 0.0,
            **{f"total/{k}": float(v) for k, v in self.intake.totals.items()},
            **{f"samples/{k}": float(v) for k, v in self.intake.sample_totals.items()},
        )
        self._last_publish_metrics = {}
        self._call(self.metrics.write(metrics))  # the dashboard logs it to wandb (streamrl.wandb_log)
        log.info(
            "step %d version %d reward %.3f loss %.4f staleness %.2f wait %.1fs",
            self.step, self.version, metrics["reward_mean"], metrics["loss"], metrics.get("staleness/mean", 0.0),
            batch.wait_s,
        )  # fmt: skip

    def _snapshot(self) -> None:
        """An HF export of this step's policy with when it was made, for offline held-out curves."""
        out = Path(self.shared.run_dir) / "snapshots" / f"step-{self.step:06d}"
        written = export_hf(self.model, Path(self.shared.model_path), out)
        if written is not None:
            info = {
                "step": self.step,
                "policy_version": self.version,
                "time": time.time(),
                "samples_trained": self.intake.sample_totals.get("trained", 0) if self.info.is_main else None,
            }
            (written / "snapshot.json").write_text(json.dumps(info))  # last: the snapshot is complete
            pruned = prune_oldest(step_dirs(out.parent, "snapshot.json"), self.config.keep_snapshots, written)
            if pruned:
                log.info("pruned snapshots %s (learner.keep_snapshots = %d)", [p.name for p in pruned],
                         self.config.keep_snapshots)  # fmt: skip

    def _export(self) -> None:
        """RUN_DIR/export/latest: a Hugging Face directory of the current policy (a gather of the whole model to
        rank 0 and a write of it), with the step and version it is of; the previous ones kept beside it as
        step-N up to ``learner.keep_exports`` in all. Nothing in the run reads it."""
        latest = Path(self.shared.run_dir) / "export" / "latest"
        written = export_hf(self.model, Path(self.shared.model_path), latest.with_name("latest.new"))
        if written is not None:
            info = {
                "step": self.step,
                "policy_version": self.version,
                "time": time.time(),
                "source": "learner",
            }
            (written / "export.json").write_text(json.dumps(info))
            replace_export(written, latest, self.config.keep_exports)
            log.info("exported step %d (version %d) to %s", self.step, self.version, latest)

    def _checkpoint(self, final: bool = False) -> None:
        """A checkpoint of this step: started in the background (learner.async_checkpoint; committed and
        acknowledged by a later :meth:`_poll_checkpoint`), or written, committed and acknowledged now (the final
        one always: a stop waits for it)."""
        self._finish_checkpoint()  # one in flight at a time: the next one's parent is the newest committed
        ledger: list[LedgerEntry] = list(self.intake.ledger) if self.info.is_main else []
        nothing_new = self._broadcast(not ledger and self.step == self._checkpointed_step)
        if final and nothing_new:
            return
        meta = CheckpointMeta(
            step=self.step,
            policy_version=self.version,
            scheduler=copy.deepcopy(self.scheduler.state_dict()),
            ledger=ledger,
            extra=copy.deepcopy(
                {
                    "skipped_steps": self.skipped_steps,
                    "totals": self.intake.totals if self.info.is_main else {},
                    "sample_totals": self.intake.sample_totals if self.info.is_main else {},
                }
            ),
        )
        if self.config.async_checkpoint and not final:
            self._pending = self.checkpoints.save_async(
                self.model, self.optimizer, meta, self._checkpoint_group
            )
            crash_point("checkpoint.async_started")
        else:
            self._acknowledge(self.checkpoints.save(self.model, self.optimizer, meta), ledger)
        self._last_checkpoint_time = time.monotonic()
        self._checkpointed_step = self.step

    def _acknowledge(self, path: Path, ledger: list[LedgerEntry]) -> None:
        """The checkpoint at ``path`` is committed: acknowledge its ledger's stream entries (rank 0)."""
        crash_point("checkpoint.before_ack")
        if self.info.is_main:
            done = self._call(self.intake.acknowledge(ledger))
            self.intake.ledger = self.intake.ledger[len(ledger) :]
            log.info("checkpoint %s durable; acknowledged %d entries", path.name, done)

    def _poll_checkpoint(self) -> None:
        """Commit and acknowledge the checkpoint being written once every rank's writes have ended (all ranks
        learn it together); nothing when none is in flight."""
        if self._pending is not None and self.checkpoints.all_written(self._pending, self.info.device):
            self._finish_checkpoint()

    def _finish_checkpoint(self) -> None:
        """Wait for the checkpoint in flight, if any, then commit and acknowledge it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        path = self.checkpoints.finish(pending)
        self._acknowledge(path, pending.meta.ledger)
        log.info(
            "checkpoint %s written in the background in %.1f s", path.name, time.monotonic() - pending.started
        )
