"""The trainer's settings, as a job spec names them: what the loss, the optimizer, the critic and the loop do.

Why apart from the code they configure: a job spec (``jobs/spec.py``) and everything that validates or
shows one (the gateway's ``/jobs`` routes, ``slime-server train``, the configuration doc) needs these
models, and none of it should load torch or Megatron for them. Plain pydantic; no torch import here
(``tests/test_import_graph.py`` checks that a gateway loads no torch).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slime_server.buffer.adapter_store import USER_ALIAS_PREFIX
from slime_server.lora_format import PROJECTIONS
from slime_server.trainer.advantages import AdvantageConfig

LossType = Literal["grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "cispo", "sft"]
KLType = Literal["k1", "k2", "k3", "low_var_kl"]
Aggregation = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]
ISLevel = Literal["token", "sequence", "geometric"]


class LossConfig(BaseModel):
    """What the policy loss computes; defaults are slime's GRPO defaults."""

    loss_type: LossType = "grpo"
    eps_clip: float = Field(0.2, gt=0, description="lower PPO clip: ratio >= 1 - eps_clip")
    eps_clip_high: float | None = Field(None, gt=0, description="upper clip (DAPO clip-higher); None = eps_clip")
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages")
    kl_coef: float = Field(0.0, ge=0, description="coefficient of the KL-to-reference loss term")
    kl_type: KLType = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus (subtracted from the loss)")
    use_tis: bool = Field(False, description="importance-weight the loss by pi_old / pi_rollout (the recorded "
                          "rollout log-probs): corrects stale (asynchronous) samples and train/inference mismatch")
    tis_mode: ISMode = Field("truncate", description="truncate: clamp the weight to [tis_clip_low, tis_clip] (TIS); "
                             "mask: weight 0 outside that range (MIS)")
    tis_level: ISLevel = Field("token", description="token: one weight per token; sequence: the product of a "
                               "sample's token ratios; geometric: their geometric mean")
    tis_clip: float = Field(2.0, gt=0, description="upper bound of the TIS weight")
    tis_clip_low: float = Field(0.0, ge=0, description="lower bound of the TIS weight")
    aggregation: Aggregation = Field("token", description="token: mean over all masked tokens of the "
                                     "batch; sequence: mean per sample, then mean over samples")

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.tis_clip_low > self.tis_clip:
            raise ValueError("tis_clip_low must not exceed tis_clip")
        return self

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


class OptimizerSettings(BaseModel):
    """Adam + schedule settings (names follow Megatron's ``--lr``, ``--lr-warmup-iters``, ...)."""

    lr: float = Field(1e-6, gt=0)
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_init: float = Field(0.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int | None = Field(None, gt=0, description="end of the decay (required unless constant)")
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.98, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")

    @model_validator(mode="after")
    def _check(self) -> OptimizerSettings:
        if self.min_lr > self.lr or self.lr_warmup_init > self.lr:
            raise ValueError("min_lr and lr_warmup_init must not exceed lr")
        if self.lr_decay_style != "constant" and self.lr_decay_steps is None:
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r} needs lr_decay_steps (total steps)")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError("lr_decay_steps must be larger than lr_warmup_steps")
        return self


# PEFT's names of the projections a LoRA adapter can sit on (Llama / Qwen); "all-linear" is all of them
LORA_TARGETS = PROJECTIONS


class LoRASettings(BaseModel):
    """A low-rank adapter beside the frozen base (PEFT's ``LoraConfig`` fields, PEFT's defaults): the policy is
    ``W x + (alpha / rank) * B A dropout(x)``. No rank-stabilised scaling: SGLang 0.5.23 serves every adapter with
    alpha / rank whatever its ``use_rslora`` says, so an rsLoRA adapter would be served other than it trained."""

    model_config = {"extra": "forbid"}

    rank: int = Field(16, ge=1, le=1024, description="r: the adapter's rank")
    alpha: float = Field(32.0, gt=0, description="lora_alpha")
    dropout: float = Field(0.0, ge=0, lt=1, description="lora_dropout: on the adapter's input, training only")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description=f"PEFT module names out of {', '.join(LORA_TARGETS)}, or 'all-linear'")
    publish: Literal["adapter", "merged"] = Field(
        "adapter", description="how a job serves what it learns: 'adapter' loads each version into the engines "
        "beside the base (engines started with LoRA on), clients name it '<served>:<name>', the base and everyone "
        "else untouched; 'merged' pushes base + adapter as the served weights, for every client")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="publish 'adapter': "
                             "the alias clients name as '<served>:<name>' (default: the job's id)")
    adapters: int = Field(1, ge=1, le=256, description="adapters trained side by side over the one frozen base, "
                          "each sample through its own (one per user); a step trains the adapters its samples name, "
                          "in one forward and backward over the shared base")
    per: Literal["job", "user"] = Field(
        "job", description="'job': one adapter, the job's alias; 'user': an online (live) job trains one adapter "
        "per user (the principal of each call: an agent key, or a frontend key's X-Slime-User) on that user's own "
        "rewarded turns, and the gateway serves each user's calls naming the served model through their own "
        "adapter (the base until their first is published); 'adapters' users hold a slot at once, a newcomer takes "
        "the least recently trained user's (saved, loaded back when they return)")

    @model_validator(mode="after")
    def _check(self) -> LoRASettings:
        if self.adapters > 1 and self.publish == "merged":
            raise ValueError("lora.publish 'merged' serves one policy: it cannot go with lora.adapters > 1")
        if self.per == "user" and self.publish == "merged":
            raise ValueError("lora.per 'user' publishes each user's adapter: it cannot go with lora.publish 'merged'")
        if self.name is not None and self.name.startswith(USER_ALIAS_PREFIX):
            raise ValueError(f"lora.name: names starting with {USER_ALIAS_PREFIX!r} are users' adapters")
        if self.target_modules != "all-linear":
            unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
            if unknown or not self.target_modules:
                raise ValueError(f"lora.target_modules: unknown {unknown or 'empty list'}; known: "
                                 f"{', '.join(LORA_TARGETS)} or 'all-linear'")
        return self

    @property
    def targets(self) -> tuple[str, ...]:
        """The targeted PEFT names, in ``LORA_TARGETS`` order."""
        chosen = LORA_TARGETS if self.target_modules == "all-linear" else set(self.target_modules)
        return tuple(t for t in LORA_TARGETS if t in chosen)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class CriticSettings(BaseModel):
    optimizer: OptimizerSettings = Field(default_factory=lambda: OptimizerSettings(lr=1e-5))
    init_from: str | None = Field(None, description="HF checkpoint directory the value model's trunk starts from "
                                  "(same architecture as the policy; default: the policy's own base weights); "
                                  "the value head always starts at zero")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value clipping around the old values; None = off")
    aggregation: Aggregation = "token"


StalePolicy = Literal["drop", "downweight", "keep"]


class OPDWeights(BaseModel):
    w_rl: float = Field(1.0, ge=0)
    w_opd: float = Field(1.0, ge=0)


class MoESettings(BaseModel):
    """A mixture-of-experts job's routing (trainer/routing_replay.py)."""

    model_config = ConfigDict(extra="forbid")

    routing_replay: Literal["rollout", "trainer", "off"] = Field(
        "off", description="rollout: every forward routes each token to the experts the engine chose for it (R3; "
        "needs the server's --enable-return-routed-experts); trainer: the training forwards route each token as the "
        "policy did before the batch's updates, recorded when its log-probs are recomputed (R2; acts with "
        "loop.num_steps_per_rollout > 1 or a KL term, else those forwards are that policy already); off: the "
        "trainer's router chooses")


class LoopSettings(BaseModel):
    """Knobs of the loop (slime's names where it has one)."""

    batch_size: int = Field(8, ge=1, description="trajectories per optimizer step (global batch)")
    n_samples_per_prompt: int = Field(1, ge=1, description="group size; a group trains only once complete")
    max_staleness: int | None = Field(2, ge=0, description="max versions between a sample's oldest "
                                      "generated token and the current policy; None = no bound")
    stale_policy: StalePolicy = Field("drop", description="what happens to samples beyond max_staleness")
    stale_decay: float = Field(0.5, gt=0, le=1, description="downweight: advantage x decay ** (lag - max)")
    drop_zero_variance_groups: bool = Field(False, description="DAPO dynamic sampling: skip groups whose "
                                            "rewards are all equal (they carry no GRPO signal)")
    max_flat_groups_in_a_row: int | None = Field(256, ge=1, description="fail the job after this many groups in a "
                                                 "row were dropped for equal rewards (or nothing generated) with "
                                                 "no step between: it could never train again; None = wait for ever")
    group_timeout_s: float | None = Field(600.0, gt=0, description="a group still short of n_samples_per_prompt "
                                          "members this long after its newest member finished is dropped (counted "
                                          "in dropped_incomplete); None = wait for ever")
    num_steps_per_rollout: int = Field(1, ge=1, description="optimizer steps per batch (slime's name): the batch "
                                       "is cut into this many mini-batches, trained in turn against log-probs "
                                       "recomputed once before the first (so the PPO ratio and clip act)")
    update_weights_interval: int = Field(1, ge=1, description="push weights every N steps")
    checkpoint_interval: int = Field(5, ge=1, description="checkpoint every N steps")
    max_steps: int | None = Field(None, ge=1, description="stop (completed) after this many steps")
    sync: bool = Field(False, description="pause generation while training + pushing (no overlap)")
    poll_interval_s: float = Field(0.2, gt=0)
    bucket_bytes: int | None = Field(None, ge=1, description="update_weight_buffer_size; None = 512 MiB")
    advantage: AdvantageConfig = Field(default_factory=lambda: AdvantageConfig(estimator="reinforce_plus_plus"))
    opd: OPDWeights | None = Field(None, description="on-policy distillation for samples carrying teacher "
                                   "log-probs (online hints): A = w_rl * A + w_opd * (teacher - student)")
    moe: MoESettings = Field(default_factory=MoESettings, description="set from the job spec's moe")

    @model_validator(mode="after")
    def _check(self) -> LoopSettings:
        if self.batch_size % self.n_samples_per_prompt:  # whole groups only: the last one would never fit
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of n_samples_per_prompt "
                             f"({self.n_samples_per_prompt})")
        if self.batch_size % self.num_steps_per_rollout:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of num_steps_per_rollout "
                             f"({self.num_steps_per_rollout})")
        return self


class Checkpoint(BaseModel):
    step: int
    version: int
    path: str
    created_at: float = Field(default_factory=time.time)


class UserSlot(BaseModel):
    """A user's adapter in a per-user LoRA job (``lora.per = 'user'``): which of the trainer's stacked adapters is
    theirs (or where it is saved while they hold none), and the versions published for them (the newest
    ``USER_VERSIONS_KEPT``), what their samples' staleness is counted in."""

    slot: int  # -1 while parked
    versions: list[int] = Field(default_factory=list)
    last_step: int = 0  # the last step that trained them (the least recent gives up its slot first)
    parked: str | None = None  # their adapter's PEFT directory while they hold no slot
    seated_step: int = 0  # the step that gave them their slot, and what it was loaded with (None: fresh): a job
    origin: str | None = None  # restored from an older checkpoint loads it again (the slot was someone else's)


class LoopState(BaseModel):
    """What survives a restart (persisted by the job layer after every step)."""

    step: int = 0
    version: int = 0
    checkpoints: list[Checkpoint] = Field(default_factory=list)
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    dropped_incomplete: int = 0
    flat_groups_in_a_row: int = 0  # groups dropped for equal rewards since the last step (check_flat_streak)
    downweighted: int = 0
    restarts: int = 0
    kept: int = 0  # rejection sampling: samples that passed and trained
    rejected: int = 0  # ... and those that did not (dropped, stored)
    waiting: str | None = None  # why the last look at the buffer found no batch (None: training)
    users: dict[str, UserSlot] = Field(default_factory=dict)  # lora.per 'user': each user's adapter slot
    parked: dict[str, UserSlot] = Field(default_factory=dict)  # ... and users who gave theirs up, saved
    # ... and the users it forgot (their adapter deleted), by alias: when; their conversations begun before never train
    forgotten: dict[str, float] = Field(default_factory=dict)
