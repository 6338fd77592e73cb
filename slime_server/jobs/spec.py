"""What a job is: ``JobSpec`` (algorithm, data, loop, optimizer, pacing, evals, logging), the statuses, and
``JobView``, the job as the API shows it. Validation happens here, at submit time, not in the trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slime_server.buffer.job_store import JobRow
from slime_server.envs.base import get_environment, verifiers_module
from slime_server.job_logging import WandbSpec
from slime_server.trainer.advantages import AdvantageConfig, Estimator
from slime_server.trainer.settings import (
    CriticSettings,
    LoopSettings,
    LoopState,
    LoRASettings,
    LossConfig,
    MoESettings,
    OptimizerSettings,
)

JobStatus = Literal["queued", "running", "paused", "completed", "failed", "cancelled"]
ACTIVE: frozenset[str] = frozenset({"queued", "running", "paused"})
Algorithm = Literal["grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo", "sft"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataSpec(_Strict):
    """Where a job's batches come from.

    ``live``: whatever rewarded traffic reaches /v1. ``dataset``: the job also plays the environment's episodes
    on its dataset through this server's /v1 (the agent runner, in-process). ``verifiers``: the same with a
    verifiers environment's rollouts and rubric rewards (``agents/verifiers_runner.py``). ``conversations``: an SFT file of
    conversations (``algorithm: sft``). ``replay``: train-only on an export (``slime-server export``), with its
    recorded tokens, masks, log-probs and rewards."""

    source: Literal["live", "dataset", "verifiers", "conversations", "replay"] = "live"
    environment: str | None = Field(None, description="dataset: a built-in name or module:attr; verifiers: the "
                                    "installed environment's module or hub id (owner/name)")
    env_args: dict[str, Any] = Field(default_factory=dict, description="verifiers: the arguments of the "
                                     "environment's load_environment()")
    sampling_args: dict[str, Any] = Field(default_factory=dict, description="verifiers: more fields for every "
                                          "model call (e.g. top_p, tool_choice), over the environment's own; "
                                          "temperature and max_tokens are data.temperature and data.max_tokens")
    dataset: str | None = Field(None, description="JSONL path: the environment's rows (default: generated), the "
                                "conversations, or the export to replay")
    input_key: str = Field("messages", description="conversations: the field holding the messages (or, with "
                           "label_key, the prompt: a string or messages)")
    label_key: str | None = Field(None, description="conversations: the field holding the answer (slime's "
                                  "prompt/label rows); unset: the assistant messages of input_key are the targets")
    tools_key: str = Field("tools", description="conversations: the field holding the tools offered (optional)")
    system_prompt: str | None = Field(None, description="conversations: a system message for rows without one")
    epochs: int = Field(1, ge=1, description="conversations: passes over the file; dataset with train false: "
                        "passes over the rows, each played n_samples_per_prompt times")
    replay_job: str | None = Field(None, description="replay: only the samples this job trained on, in its own "
                                   "batches and order (the export records each sample's job and step)")
    num_prompts: int | None = Field(None, ge=1, description="dataset: the rows generated when no dataset file is "
                                    "given (unset: 256), or at most this many of the file's first rows; verifiers: at "
                                    "most this many of the environment's rows (after the seed's shuffle; unset: all)")
    seed: int = Field(0, description="the generated rows' seed (dataset without a file), the rows' shuffle "
                      "(verifiers), the conversations' shuffle")
    concurrency: int = Field(8, ge=1, description="episodes in flight")
    temperature: float = Field(1.0, ge=0)
    max_tokens: int = Field(64, ge=1)


class PacingSpec(_Strict):
    max_buffered: int = Field(256, ge=1, description="unconsumed rewarded trajectories before /v1 answers 429")
    retry_after_s: float = Field(2.0, gt=0)


class EvalSpec(_Strict):
    """An evaluation set: episodes through the same runner (greedy by default, or sampled with fixed
    seeds: the same random numbers for every policy version), serve-only, never trained on."""

    name: str = Field(min_length=1, max_length=100)
    source: Literal["environment", "verifiers"] = Field("environment", description="environment: a built-in or "
                                                        "module:attr environment; verifiers: a verifiers "
                                                        "environment, its eval rows (its training rows if it has none)")
    environment: str
    env_args: dict[str, Any] = Field(default_factory=dict, description="verifiers: its load_environment() arguments")
    dataset: str | None = Field(None, description="JSONL path; default: the environment's generated rows")
    num_prompts: int = Field(32, ge=1)
    seed: int = 12345
    every_steps: int = Field(10, ge=1, description="evaluate after every N training steps (and at step 0)")
    max_tokens: int = Field(64, ge=1)
    concurrency: int = Field(8, ge=1)
    temperature: float = Field(0.0, ge=0, description="0 = greedy; > 0 samples with seeds from `seed`")

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        if self.source == "verifiers":
            verifiers_module(self.environment)
            if self.dataset is not None:
                raise ValueError("a verifiers eval set plays the environment's own eval rows: no dataset")
            return self
        if self.env_args:
            raise ValueError("env_args are for an eval set with source 'verifiers'")
        get_environment(self.environment)
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise ValueError(f"eval dataset {self.dataset!r} is not a file")
        return self


# estimators whose baseline is the group mean (a group of one learns nothing)
GROUP_BASELINES = ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus_baseline")


class RejectionSpec(_Strict):
    """Rejection sampling (``algorithm: sft``): of each whole group, only the samples that pass train."""

    threshold: float | None = Field(1.0, description="keep samples whose reward is >= this (None: any)")
    keep: Literal["all_passing", "best_of_n"] = Field("all_passing", description="every passing sample, or only "
                                                       "each group's best (if it passes)")


class JobSpec(_Strict):
    """``POST /jobs`` body."""

    name: str | None = Field(None, max_length=200)
    base_model: str | None = Field(None, description="must be the served model (a live job trains it)")
    algorithm: Algorithm = Field("reinforce_plus_plus", description="the advantage estimator and its loss; 'ppo' "
                                 "trains a critic (value model) beside the policy and uses GAE")
    critic: CriticSettings = Field(default_factory=CriticSettings, description="the value model of algorithm 'ppo': "
                                   "its optimizer (lr), value clipping, loss aggregation and starting checkpoint")
    reference_model: str | None = Field(None, description="HF checkpoint directory of the KL reference (same "
                                        "architecture as the served model); default: the served base weights")
    lora: LoRASettings | None = Field(None, description="train a LoRA adapter over the frozen served model instead "
                                      "of all its weights (rank, alpha, dropout, target_modules as PEFT names them): "
                                      "only the adapter is in the optimizer and the checkpoints (each "
                                      "checkpoint also holds it as a PEFT directory, adapter/); the KL reference is "
                                      "the base under the adapter; lora.publish says how it is served (its own "
                                      "alias, default, or merged into the served weights)")
    data: DataSpec = Field(default_factory=DataSpec)
    train: bool = Field(True, description="false: rollout-only (slime's debug-rollout-only): the dataset's "
                        "episodes are played and recorded, data.epochs times over, and nothing is trained")
    rejection: RejectionSpec | None = Field(None, description="rejection sampling: with algorithm 'sft' on "
                                            "played or live episodes, train only the samples that pass")
    loop: LoopSettings = Field(default_factory=LoopSettings)
    moe: MoESettings = Field(default_factory=MoESettings, description="a mixture-of-experts model's routing: replay "
                             "the engine's routes in the trainer (routing_replay: rollout, R3), the policy's own "
                             "from before the batch's updates (trainer, R2), or neither (off)")
    loss: dict[str, Any] = Field(default_factory=dict, description="LossConfig overrides (loss_type: the objective, "
                                 "apart from the estimator `algorithm` picks, e.g. grpo advantages under 'cispo'; "
                                 "eps_clip, eps_clip_high, "
                                 "kl_coef + kl_type: a KL term to a frozen copy of the base weights, use_tis + "
                                 "tis_mode/tis_level/tis_clip: off-policy correction, on unless loop.sync, ...)")
    optimizer: OptimizerSettings = Field(default_factory=lambda: OptimizerSettings(lr=1e-5))
    pacing: PacingSpec = Field(default_factory=PacingSpec)
    max_tokens_per_micro_batch: int | None = Field(None, gt=0, description="default: the server's trainer setting")
    eval: list[EvalSpec] = Field(default_factory=list, description="evaluated on a schedule, per policy version")
    wandb: WandbSpec | None = Field(None, description="also log the job's metrics to Weights & Biases "
                                    "(needs the wandb package on the server; TensorBoard files are always written)")

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        self._check_modes()
        if self.data.source == "dataset":
            if not self.data.environment:
                raise ValueError("data.source 'dataset' needs data.environment (e.g. 'calculator')")
            get_environment(self.data.environment)  # unknown names fail at submit time
            if self.data.dataset is not None and not Path(self.data.dataset).is_file():
                raise ValueError(f"data.dataset {self.data.dataset!r} is not a file")
        if self.plays_episodes():
            need = self.loop.batch_size + self.data.concurrency
            if self.train and self.pacing.max_buffered < need:
                # the buffer holds < batch_size samples of complete groups plus the members of the groups
                # in flight (< concurrency); a smaller limit can pace out the episodes that would complete a
                # group while the trainer waits for complete groups: a deadlock
                raise ValueError(f"pacing.max_buffered ({self.pacing.max_buffered}) must be >= loop.batch_size + "
                                 f"data.concurrency ({need}) for a job that plays episodes")
        if self.algorithm != "sft" and self.loop.n_samples_per_prompt == 1 and self.estimator() in GROUP_BASELINES:
            raise ValueError(f"algorithm {self.algorithm!r} subtracts its group's mean reward: with "
                             "loop.n_samples_per_prompt 1 every advantage is 0; use 'reinforce_plus_plus' (batch "
                             "baseline) or groups of n >= 2")
        if self.algorithm == "sft" and (self.loop.advantage.kl_coef > 0 or self.loop.stale_policy == "downweight"):
            raise ValueError("algorithm 'sft' has no advantages to shape or down-weight: loop.advantage.kl_coef "
                             "and stale_policy 'downweight' are for RL")
        if self.loop.advantage.kl_coef > 0 and self.estimator() not in ("reinforce_plus_plus",
                                                                         "reinforce_plus_plus_baseline", "gae"):
            raise ValueError("loop.advantage.kl_coef shapes REINFORCE++ rewards; for "
                             f"{self.algorithm!r} use loss.kl_coef (the KL loss term)")
        LossConfig(**self.loss_config())  # fail at submit time, not in the trainer
        return self

    def _data_fields_read(self, source: str | None = None, train: bool | None = None) -> set[str]:
        """The ``data`` fields a job with ``source`` (default: this job's) reads, besides ``source``."""
        train = self.train if train is None else train
        played = {"environment", "num_prompts", "seed", "concurrency", "temperature", "max_tokens"} | (
            set() if train else {"epochs"})
        return {"live": set(),
                "dataset": played | {"dataset"},
                "verifiers": played | {"env_args", "sampling_args"},
                "conversations": {"dataset", "input_key", "label_key", "tools_key", "system_prompt", "epochs", "seed"},
                "replay": {"dataset", "replay_job"}}[source or self.data.source]

    def _check_unread_data(self) -> None:
        """A ``data`` field set (to other than its default) that the job's source never reads is refused by name,
        not ignored."""
        d = self.data
        fields = type(d).model_fields
        unread = sorted(n for n in d.model_fields_set - {"source"} - self._data_fields_read()
                        if getattr(d, n) != fields[n].get_default(call_default_factory=True))
        if d.source == "dataset" and d.dataset is not None and d.seed != fields["seed"].default:
            raise ValueError("data.seed generates a dataset job's rows when it has no data.dataset; a dataset file's "
                             "rows are played in their order")
        if not unread:
            return
        sources = ("dataset", "verifiers", "conversations", "replay")

        def readers(name: str) -> str:
            if name == "epochs":
                return ("data.epochs is for data.source 'conversations', and for 'dataset' or 'verifiers' with train "
                        "false (rollout-only: passes over the rows)")
            who = [s for s in sources if name in self._data_fields_read(s)]
            return f"data.{name} is for data.source {' or '.join(repr(s) for s in who)}"

        raise ValueError(f"not read by a job with data.source {d.source!r}: " + "; ".join(map(readers, unread)))

    def _check_modes(self) -> None:
        d = self.data
        self._check_unread_data()
        if d.source == "verifiers":
            if not d.environment:
                raise ValueError("data.source 'verifiers' needs data.environment: an installed verifiers "
                                 "environment's module or hub id (owner/name)")
            verifiers_module(d.environment)  # not installed: a 400 now; its arguments are checked as it loads
            if d.dataset is not None:
                raise ValueError("a verifiers environment brings its own rows (its data.env_args choose them): "
                                 "data.dataset is not read")
            ours = sorted({"temperature", "max_tokens", "max_completion_tokens", "model", "messages", "tools", "n",
                           "stream"} & set(d.sampling_args))
            if ours:
                raise ValueError(f"data.sampling_args {ours}: the job sets these (data.temperature, "
                                 "data.max_tokens; the environment its messages and tools)")
        elif d.env_args or d.sampling_args:
            raise ValueError("data.env_args and data.sampling_args are for data.source 'verifiers'")
        if d.source in ("conversations", "replay"):
            if not d.dataset or not Path(d.dataset).is_file():
                raise ValueError(f"data.source {d.source!r} needs data.dataset, a JSONL file "
                                 f"({'conversations' if d.source == 'conversations' else 'an export'})")
        if self.lora is not None and self.lora.per == "user" and d.source != "live":
            raise ValueError("lora.per 'user' learns each user's adapter from their own live conversations: "
                             "data.source must be 'live'")
        if self.lora is not None and self.lora.per == "job" and self.lora.adapters > 1:
            raise ValueError("lora.adapters > 1 are per-user slots: a job publishes one adapter unless lora.per is "
                             "'user'")
        if d.source == "conversations" and self.algorithm != "sft":
            raise ValueError("data.source 'conversations' trains supervised: set algorithm 'sft'")
        if self.algorithm == "sft" and d.source in ("live", "dataset", "verifiers") and self.rejection is None:
            raise ValueError("algorithm 'sft' on played episodes is rejection sampling: set rejection "
                             "(e.g. {threshold: 1.0}), or train on data.source 'conversations' or 'replay'")
        if self.rejection is not None and (self.algorithm != "sft" or d.source not in ("live", "dataset", "verifiers")):
            raise ValueError("rejection sampling trains SFT on played episodes: algorithm 'sft' with data.source "
                             "'dataset', 'verifiers' or 'live'")
        if not self.train and not self.plays_episodes():
            raise ValueError("train false (rollout-only) plays a dataset: data.source 'dataset' (or 'verifiers') "
                             "with an environment")
        if d.replay_job is not None and d.source != "replay":
            raise ValueError("data.replay_job is for data.source 'replay'")
        for name, path in (("reference_model", self.reference_model), ("critic.init_from", self.critic.init_from)):
            if path is not None and not (Path(path) / "config.json").is_file():
                raise ValueError(f"{name} {path!r} is not a Hugging Face checkpoint directory (no config.json)")
        if self.reference_model is not None and not self.needs_reference():
            raise ValueError("reference_model is the KL term's reference: set loss.kl_coef or loop.advantage.kl_coef")
        if self.critic.init_from is not None and self.algorithm != "ppo":
            raise ValueError("critic.init_from is for algorithm 'ppo' (the only one with a critic)")

    def plays_episodes(self) -> bool:
        """Whether the job plays its own episodes through /v1 (an environment's rows) beside training."""
        return self.data.source in ("dataset", "verifiers")

    def estimator(self) -> Estimator:
        if self.algorithm == "sft":
            return "reinforce_plus_plus"  # unused: SFT computes no advantages
        return "gae" if self.algorithm == "ppo" else self.algorithm

    def loss_config(self) -> dict[str, Any]:
        """The trainer's LossConfig. Off-policy correction (TIS on the recorded rollout log-probs) is on by
        default for asynchronous jobs, whose samples may be up to ``max_staleness`` versions old (not for SFT,
        whose targets are not the policy's samples to correct)."""
        return {"loss_type": self.algorithm if self.algorithm != "dr_grpo" else "grpo",
                "use_tis": not self.loop.sync and self.algorithm != "sft", **self.loss}

    def needs_reference(self) -> bool:
        """Whether the trainer keeps a frozen reference model (KL loss or KL reward shaping)."""
        return float(self.loss.get("kl_coef", 0.0) or 0.0) > 0 or self.loop.advantage.kl_coef > 0

    def loop_settings(self) -> LoopSettings:
        adv = self.loop.advantage.model_copy(update={"estimator": self.estimator()})
        return self.loop.model_copy(update={"advantage": AdvantageConfig.model_validate(adv.model_dump()),
                                            "moe": self.moe})


class JobView(BaseModel):
    """``GET /jobs/{id}``."""

    id: str
    object: Literal["job"] = "job"
    name: str | None
    status: str
    spec: dict[str, Any]
    step: int
    policy_version: int
    checkpoints: list[dict[str, Any]]
    dropped_stale: int
    dropped_zero_variance: int
    dropped_incomplete: int
    downweighted: int
    kept: int = Field(0, description="rejection sampling: samples that passed and trained")
    rejected: int = Field(0, description="rejection sampling: samples that did not pass (stored, never trained)")
    restarts: int
    waiting: str | None = Field(None, description="why the job is not training now (None: it is, or it "
                                "has not looked at the buffer yet)")
    error: str | None
    work_dir: str | None = Field(None, description="the job's directory on the server: checkpoints, tb/ "
                                 "(TensorBoard), the trainer ranks' logs")
    created_at: float
    updated_at: float


def view(row: JobRow, work_dir: str | None = None) -> JobView:
    st = LoopState.model_validate(row.state)
    return JobView(id=row.id, name=row.spec.get("name"), status=row.status, spec=row.spec, step=st.step,
                   policy_version=st.version, checkpoints=[c.model_dump() for c in st.checkpoints],
                   dropped_stale=st.dropped_stale, dropped_zero_variance=st.dropped_zero_variance,
                   dropped_incomplete=st.dropped_incomplete, downweighted=st.downweighted, kept=st.kept,
                   rejected=st.rejected, restarts=st.restarts,
                   waiting=st.waiting if row.status == "running" else None, error=row.error, work_dir=work_dir,
                   created_at=row.created_at, updated_at=row.updated_at)
