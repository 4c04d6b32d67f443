"""Config section owned by the learner."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.configlib import Section

PolicyLossName = Literal["ppo", "decoupled_ppo", "tis", "icepop", "gspo"]
Aggregation = Literal["token-mean", "seq-mean", "seq-mean-token-sum"]
MixedPrecision = Literal["auto", "off", "bf16"]
KlEstimator = Literal["k1", "k2", "k3"]
LrSchedule = Literal["constant", "linear", "cosine"]


class LossConfig(Section):
    """The policy loss and its knobs (docs/losses.md has every formula)."""

    policy_loss: PolicyLossName = Field(
        "ppo",
        description="Policy loss by name: ppo (clip against the behaviour policy; the default, chosen by the "
        "staleness ablation), decoupled_ppo, tis, icepop or gspo.",
    )
    aggregation: Aggregation = Field(
        "token-mean",
        description="token-mean over the step's valid tokens, seq-mean, or seq-mean-token-sum (Dr. GRPO).",
    )
    norm_length: int = Field(
        1024, ge=1, description="Constant divisor of seq-mean-token-sum (Dr. GRPO's generation budget)."
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below: ratio >= 1 - eps_low.")
    eps_high: float = Field(
        0.28, ge=0, description="PPO clip above: ratio <= 1 + eps_high (clip-higher when > eps_low)."
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1,
        description="Dual-clip bound c: a negative-advantage token's loss is at most c * |A| (None: off). "
        "It bounds what one stale token can contribute when the ratio runs away (ppo, gspo at eta > 0).",
    )
    is_level: Literal["token", "sequence"] = Field(
        "token",
        description="Importance weights per token, or per sequence (geometric mean) for decoupled_ppo/tis/icepop.",
    )
    behav_cap: float | None = Field(
        5.0, gt=1, description="decoupled_ppo: bound on the behaviour weight pi_prox / mu (None: unbounded)."
    )
    behav_cap_mode: Literal["mask", "truncate"] = Field(
        "mask", description="decoupled_ppo: zero the weight above behav_cap (mask) or clamp it to it."
    )
    tis_cap: float = Field(2.0, gt=0, description="tis: cap C of the weight min(pi_old / mu, C).")
    icepop_low: float = Field(0.5, ge=0, description="icepop: weights below this are zeroed.")
    icepop_high: float = Field(5.0, gt=0, description="icepop: weights above this are zeroed.")
    gspo_eps_low: float = Field(3e-4, ge=0, lt=1, description="gspo: clip of the sequence ratio below.")
    gspo_eps_high: float = Field(4e-4, ge=0, description="gspo: clip of the sequence ratio above.")
    gspo_log_ratio_cap: float = Field(
        1.0, gt=0, description="gspo: the sequence log-ratio to mu is capped at +-this (ratio <= e^cap)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the frozen reference model (the initial policy); 0: no reference.",
    )
    kl_estimator: KlEstimator = Field(
        "k3",
        description="Per-token KL estimator: k1 (log-ratio), k2 (half its square) or k3 (unbiased, >= 0).",
    )
    kl_mode: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: kl_coef * KL(pi || ref) added to the loss per token; reward: kl_coef * the summed "
        "KL of the behaviour tokens subtracted from each sample's reward before advantages.",
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: -entropy_coef * the mean token entropy added to the loss."
    )
    log_ratio_clamp: float = Field(
        20.0, gt=0, description="Log-ratios are clamped to +-this before exp, so staleness never gives inf."
    )
    mask_truncated: bool = Field(
        False, description="Exclude outputs cut at the length limit (overlong) from the loss."
    )

    @model_validator(mode="after")
    def _check_bands(self) -> LossConfig:
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low = {self.icepop_low} must be below icepop_high = {self.icepop_high}")
        return self


class AdvantageConfig(Section):
    """Group-relative advantage estimation and DAPO dynamic sampling."""

    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "grpo",
        description="grpo (group mean/std), dr_grpo (mean only), rloo (leave-one-out baseline), reinforce_pp "
        "(REINFORCE++: rewards whitened over the step's tokens) or reinforce_pp_baseline (group mean subtracted, "
        "then whitened over the step).",
    )
    std_normalise: bool = Field(True, description="grpo: divide by the group's standard deviation.")
    eps: float = Field(1e-6, gt=0, description="grpo: added to the group std before dividing.")
    whiten_eps: float = Field(
        1e-8, gt=0, description="reinforce_pp*: added to the step's variance before the square root (verl's)."
    )
    drop_zero_signal: bool = Field(
        False, description="DAPO dynamic sampling: drop (and count) groups whose rewards are all equal."
    )

    @model_validator(mode="after")
    def _check_dynamic_sampling(self) -> AdvantageConfig:
        if self.drop_zero_signal and self.estimator == "reinforce_pp":
            raise ValueError(
                "drop_zero_signal = true with estimator = 'reinforce_pp': a group whose rewards are all equal "
                "still has signal there (no group baseline); use reinforce_pp_baseline or drop_zero_signal = false"
            )
        return self


QWEN2_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(Section):
    """LoRA adapters (peft) trained under FSDP2 on a frozen base; engines get only the adapter (docs/lora.md)."""

    rank: int = Field(
        0, ge=0, description="LoRA rank r of every adapted projection; 0 trains the full model."
    )
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(QWEN2_PROJECTIONS),
        description="Linear layers (by leaf name) that get an adapter: Qwen2's attention and MLP projections.",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _check_targets(self) -> LoraSection:
        names = self.target_modules
        bad = [n for n in names if not n.isidentifier()]
        if self.enabled and (not names or bad or len(set(names)) != len(names)):
            raise ValueError(
                f"target_modules = {names!r}: expected distinct module leaf names such as {list(QWEN2_PROJECTIONS)}"
            )
        return self


class LearnerConfig(Section):
    """The FSDP2 learner: batches from the stream, off-policy corrected loss, checkpoints."""

    world_size: int = Field(2, ge=1, description="Learner ranks (gloo on CPU, NCCL on GPU).")
    groups_per_step: int = Field(
        16,
        ge=1,
        description="Prompt groups consumed per optimizer step (16 x 8 samples learns steadily here).",
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    checkpoint_every: int = Field(5, ge=1, description="Optimizer steps between durable checkpoints.")
    checkpoint_interval_s: float = Field(
        60.0, gt=0, description="Upper bound on the wall time between checkpoints, seconds."
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Token budget of a micro-batch: real tokens with varlen packing, rows x longest row without.",
    )
    varlen: bool = Field(
        True,
        description="Pack each micro-batch's sequences into one row without padding (position ids restart per "
        "sequence, attention never crosses one); false: one right-padded row per sequence or shared prompt.",
    )
    attention_kernel: Literal["auto", "sdpa", "flash_varlen"] = Field(
        "auto",
        description="Attention over packed rows: flash_varlen (flash-attention's varlen kernel: CUDA, bf16, "
        "flash-attn installed), sdpa (causal SDPA per bucket of similar-length samples), or auto (the first "
        "that can serve).",
    )
    loss_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="Tokens per chunk of the loss's lm-head, log-softmax and entropy (recomputed in backward): "
        "the loss holds one [chunk, vocab] block of logits, never [tokens, vocab].",
    )
    share_prompts: bool = Field(
        True,
        description="Run a prompt once per micro-batch row for all the samples that share it (a group), "
        "not once per sample; the loss and gradients stay the same.",
    )
    skip_zero_gradient: bool = Field(
        True,
        description="Do not run samples whose advantage is 0 on every loss token (all-equal-reward groups): "
        "their gradient is exactly 0 and the normaliser still counts them, so the update is unchanged; "
        "entropy, clip and KL metrics then cover the trained samples only. Off with a reference KL or an entropy bonus.",
    )
    intake_order: Literal["oldest_first", "arrival"] = Field(
        "oldest_first",
        description="Which delivered groups a step takes first: oldest policy version first (a group that "
        "finished late is trained before fresher ones instead of going stale behind them) or stream order.",
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss selection and knobs.")
    advantage: AdvantageConfig = Field(
        default_factory=AdvantageConfig, description="Advantage estimator and dynamic sampling."
    )
    lora: LoraSection = Field(
        default_factory=LoraSection, description="LoRA adapters instead of full fine-tuning (rank 0: off)."
    )
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps; 0 runs until stopped.")
    min_step_interval_s: float = Field(
        0.0,
        ge=0,
        description="Take each batch at least this many seconds after the previous one (0: off); emulates a "
        "trainer slower than its rollout fleet, so generation really lags (benchmarks/staleness_ablation).",
    )
    publish_every: int = Field(1, ge=1, description="Publish (sync) weights every k optimizer steps.")
    snapshot_every: int = Field(
        0,
        ge=0,
        description="Export a Hugging Face snapshot every k steps to RUN_DIR/snapshots/step-N (learning curves); 0: off.",
    )
    keep_snapshots: int = Field(
        10,
        ge=1,
        description="Snapshots kept in RUN_DIR/snapshots; the oldest are deleted after each new one.",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up over this many steps.")
    lr_schedule: LrSchedule = Field(
        "constant",
        description="After warm-up: constant, or linear / cosine decay to min_lr_ratio * lr at lr_decay_steps.",
    )
    lr_decay_steps: int = Field(
        0,
        ge=0,
        description="Step at which a linear or cosine decay reaches its floor; 0: learner.max_steps.",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Floor of a decaying learning rate, as a fraction of lr."
    )
    ppo_minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer updates per step: the step's groups split into this many minibatches, each its "
        "own update, all clipped against the proximal policy (the weights before the step's first update).",
    )
    ppo_epochs: int = Field(
        1, ge=1, description="Passes over the step's minibatches (updates per step = minibatches x epochs)."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    keep_checkpoints: int = Field(3, ge=1, description="How many complete checkpoints to keep.")
    async_checkpoint: bool = Field(
        True,
        description="Write checkpoints in the background (torch.distributed.checkpoint.async_save: the step "
        "waits only for a copy of the state to host memory); a checkpoint's groups are acknowledged once it is "
        "durable and committed, and the final one is written before the learner exits.",
    )
    export_every: int = Field(
        0,
        ge=0,
        description="Write RUN_DIR/export/latest, a Hugging Face export of the policy, every k steps (a gather "
        "of the whole model to rank 0 and a write, on the training path); 0: never during the run. "
        "`streamrl export RUN_DIR [--step N]` builds one from any checkpoint offline.",
    )
    export_at_end: bool = Field(
        True, description="Write RUN_DIR/export/latest when the learner stops (max_steps reached or a stop)."
    )
    keep_exports: int = Field(
        1,
        ge=1,
        description="The learner's exports kept: latest, and the previous ones as RUN_DIR/export/step-N "
        "(oldest deleted first); 1: latest only. Those of `streamrl export` are never deleted.",
    )
    reference_offload: bool = Field(
        False,
        description="Keep the KL reference's FSDP2 shards in host memory, copied to the device for each forward "
        "(it is only read): GPU memory for the policy at the cost of a host-to-device copy per reference pass.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer in backward (torch's non-reentrant checkpoint per layer, "
        "under FSDP2): only each layer's input is kept, for about one more forward per step.",
    )
    mixed_precision: MixedPrecision = Field(
        "auto",
        description="FSDP2 compute dtype: bf16 (bf16 forward/backward, fp32 master weights, optimizer state, "
        "gradient reduction and log-probs), off (fp32), or auto (bf16 on a GPU that supports it, else off).",
    )
    max_seq_len: int | None = Field(
        None,
        ge=2,
        description="Longest sample (prompt + output tokens) the learner trains; a group with a longer one is "
        "dropped as too_long. None: the model's max_position_embeddings (a larger value is refused).",
    )
    consumer_name: str = Field(
        "learner-0", description="Stable consumer name; a restart gets its entries back."
    )
    pg_timeout_s: float = Field(300.0, gt=0, description="Timeout of the learner's own collectives, seconds.")
    idle_check_s: float = Field(
        2.0,
        gt=0,
        description="While waiting for data, how often the learner checks for engines to bring back to the "
        "current policy (restarted, or out of quarantine), seconds.",
    )
    grace_s: float = Field(
        30.0, gt=0, description="SIGTERM grace: finish the step, checkpoint, exit within it."
    )
    wandb_mode: str = Field(
        "offline",
        description="The run's wandb run (logged by the dashboard, the archive's artifact added): offline, online "
        "or disabled.",
    )
    seed: int = Field(0, description="Seed of the learner's RNGs.")
    cpu_affinity: list[int] = Field(
        default_factory=list,
        description="CPU cores the learner ranks are pinned to (empty: not pinned); disjoint from the engines' "
        "they stand in for separate training GPUs.",
    )

    @model_validator(mode="after")
    def _check_trust_region(self) -> LearnerConfig:
        if self.ppo_minibatches > self.groups_per_step:
            raise ValueError(
                f"ppo_minibatches = {self.ppo_minibatches} exceeds groups_per_step = {self.groups_per_step}: "
                "each minibatch needs at least one group"
            )
        if self.lr_schedule != "constant" and self.max_steps == 0 and self.lr_decay_steps == 0:
            raise ValueError(
                f"lr_schedule = {self.lr_schedule!r} decays to its floor at lr_decay_steps, which defaults to "
                "max_steps; both are 0 (run until stopped): set lr_decay_steps"
            )
        return self

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates in one learner step (one batch of groups)."""
        return self.ppo_minibatches * self.ppo_epochs


class SftConfig(Section):
    """``streamrl sft``: supervised training of shared.model_path on a JSONL or Parquet dataset, on the learner's
    model code (sharded loading, FSDP2 over world_size ranks, checkpoints under RUN_DIR/checkpoints, resumed from
    the newest one) and an HF export of the result at RUN_DIR/export/latest (docs/sft.md)."""

    data: str | None = Field(
        None,
        description="A .jsonl/.json (JSON lines) or .parquet file: rows of {prompt, completion} (loss on the "
        "completion and EOS) or {messages: [{role, content, loss?}]} (chat template; loss on assistant turns unless "
        "a message's loss says otherwise).",
    )
    world_size: int = Field(1, ge=1, description="Training ranks (gloo on CPU, NCCL on GPU).")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    batch_size: int = Field(
        8,
        ge=1,
        description="Examples per optimizer step, over all ranks (the data is walked in a seeded order).",
    )
    micro_batches: int = Field(
        1, ge=1, description="Each rank's share of a step is cut into this many length-sorted, padded pieces."
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up over this many steps.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="After warm-up: constant, or cosine from lr to final_lr_ratio * lr at max_steps.",
    )
    final_lr_ratio: float = Field(
        1.0, ge=0, le=1, description="cosine: the learning rate at max_steps over lr."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.98), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    max_seq_len: int | None = Field(
        None,
        ge=2,
        description="Refuse a dataset row longer than this many tokens (None: the model's context).",
    )
    checkpoint_every: int = Field(50, ge=1, description="Steps between checkpoints (and one at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="How many complete checkpoints to keep.")
    export_at_end: bool = Field(
        True, description="Write RUN_DIR/export/latest, an HF directory of the result."
    )
    mixed_precision: MixedPrecision = Field(
        "auto",
        description="FSDP2 compute dtype: bf16, off (fp32), or auto (bf16 on a GPU with it, else off).",
    )
    activation_checkpointing: bool = Field(False, description="Recompute each decoder layer in backward.")
    pg_timeout_s: float = Field(300.0, gt=0, description="Timeout of the ranks' collectives, seconds.")
    grace_s: float = Field(
        30.0, gt=0, description="SIGTERM grace of the ranks before they are killed, seconds."
    )
    seed: int = Field(0, ge=0, description="Seed of the data order and of torch's RNG.")

    @model_validator(mode="after")
    def _check_equal_shares(self) -> SftConfig:
        # every rank must run as many forward passes as the others (FSDP2's collectives pair them up)
        if self.batch_size % (self.world_size * self.micro_batches):
            raise ValueError(
                f"sft.batch_size = {self.batch_size} is not a multiple of sft.world_size x sft.micro_batches = "
                f"{self.world_size * self.micro_batches}: every rank needs as many equal pieces as the others"
            )
        return self
