"""A trainer rank: one process of the Megatron-core trainer (TP x DP over gloo on CPU, nccl on GPU).

``TrainerRank`` is a plain class so it runs the same in a test process, under torchrun-style
env vars, or as a Ray actor (``create_trainer_group`` starts ``world_size`` of them and points
them at one rendezvous). Every collective method (``train_step``, ``compute_logprobs``,
``save_checkpoint``, ``named_hf_tensors``) must be called on ALL ranks with the same arguments;
``TrainerGroup`` does that for Ray and returns rank 0's answer.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, Field

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.lora_format import ADAPTER_DIR
from slime_server.trainer.adapter_adam import read_slot_adam, save_slot_adam
from slime_server.trainer.adapter_isolation import set_adapter as set_adapter_slot
from slime_server.trainer.adapter_push import AdapterPusher
from slime_server.trainer.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from slime_server.trainer.convert import iter_hf_tensors, load_hf_checkpoint_into
from slime_server.trainer.critic import build_value_model, compute_values, critic_step
from slime_server.trainer.lora import adapters_disabled, attach_lora
from slime_server.trainer.model import build_gpt_model
from slime_server.trainer.optimizer import OptimizerBundle, build_optimizer
from slime_server.trainer.parallel import destroy_parallel, init_parallel, open_rendezvous
from slime_server.trainer.peft_io import adapter_config, peft_state_dict, read_peft_adapter, save_peft_adapter
from slime_server.trainer.pipeline import gather_stages, pipeline_hf_tensors
from slime_server.trainer.settings import CriticSettings, LoRASettings, OptimizerSettings
from slime_server.trainer.train_step import (
    TrainStepSettings,
    compute_logprobs,
    compute_logprobs_and_routes,
    train_step,
)
from slime_server.trainer.types import TrainSample
from slime_server.trainer.warm_ranks import WARM
from slime_server.trainer.weight_push import DEFAULT_BUCKET_BYTES, WeightPusher, is_push_sender
from slime_server.utils.affinity import pin_process
from slime_server.utils.shm import forget_ranks, reap_dead_pids, reap_own, record_ranks
from slime_server.weights import SharedStaging, share_in_place

if TYPE_CHECKING:
    from slime_server.trainer.convert import Staging

log = logging.getLogger(__name__)


class RendezvousInfo(BaseModel):
    """torch.distributed rendezvous of one trainer group (torchrun's env vars, as a model)."""

    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(gt=0, lt=65536)

    def export(self) -> None:
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


@dataclass(frozen=True)
class ProcessStart:
    """What a rank process started with, that a job changes: its cores, torch's threads and default seed."""

    cores: frozenset[int]
    threads: int
    seed: int

    @classmethod
    def capture(cls) -> ProcessStart:
        return cls(frozenset(os.sched_getaffinity(0)), torch.get_num_threads(), torch.initial_seed())

    def restore(self) -> None:
        if set(os.sched_getaffinity(0)) != self.cores:
            pin_process(sorted(self.cores))
        torch.set_num_threads(self.threads)
        torch.manual_seed(self.seed)


class TrainerRankSettings(BaseModel):
    """Everything one rank needs to build itself."""

    hf_path: str
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1, description="pipeline stages (Megatron's 1F1B schedule; gloo p2p on CPU)")
    seed: int = 1234
    bf16: bool = Field(False, description="bf16 params (GPU); fp32 on CPU")
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    train: TrainStepSettings = Field(default_factory=TrainStepSettings)
    torch_threads: int = Field(1, ge=1)
    cpus: list[int] | None = Field(None, description="cores this rank runs on (None: any; TrainerSettings.cpus)")
    megatron_args: dict[str, Any] = Field(default_factory=dict, description="TransformerConfig overrides")
    engine_api_key: str | None = Field(None, description="the engines' key (SGLang's --api-key) for weight pushes")
    weight_sync: Literal["auto", "tensor", "distributed"] = "auto"
    reference_path: str | None = Field(None, description="HF checkpoint directory of the reference model (same "
                                       "architecture); default: the policy's base weights at hf_path")
    reference: bool = Field(False, description="keep a frozen reference model (the base weights at hf_path) for "
                            "the KL loss and KL reward shaping; costs one more copy of the weights and a forward")
    critic: CriticSettings | None = Field(None, description="train a value model (PPO with GAE) beside the policy, "
                                          "initialised from hf_path; checkpointed with it")
    lora: LoRASettings | None = Field(None, description="train a LoRA adapter over the frozen base (only the "
                                      "adapter in the optimizer and the checkpoints); its KL reference is the base "
                                      "with the adapter switched off, unless reference_path names another model")
    portable_checkpoints: bool = Field(True, description="checkpoints also hold the policy gathered on rank 0 "
                                       "(weights, Adam moments), so they resume on another TP x PP layout; off for "
                                       "models too large to gather on one rank")


class TrainerRank:
    """One trainer process. ``setup`` joins the group and loads the HF weights into Megatron."""

    def __init__(self, settings: TrainerRankSettings, rendezvous: RendezvousInfo | None = None) -> None:
        self.settings = settings
        self.rendezvous = rendezvous
        self.bundle: OptimizerBundle | None = None
        self.reference: torch.nn.Module | None = None
        self.critic: OptimizerBundle | None = None
        self.step = 0
        self.policy_version = 0
        self._store: Any = None  # rank 0's rendezvous store (open_rendezvous), bound before the others join
        self._start = ProcessStart.capture()  # what reuse() gives back to a process kept for another job

    @staticmethod
    def node_ip() -> str:
        """This host's IP as the other ranks reach it (Ray's view of the node; loopback outside Ray)."""
        import socket

        try:
            import ray

            return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except ImportError:
            return socket.gethostbyname(socket.gethostname())

    def open_rendezvous(self, world_size: int) -> tuple[str, int]:
        """Rank 0, before ``setup``: the group's rendezvous store, bound now on a port the OS picks; this node's
        IP and that port, for every rank's ``RendezvousInfo``."""
        self._store = open_rendezvous(world_size)
        return self.node_ip(), int(self._store.port)

    def setup(self, rendezvous: RendezvousInfo | None = None) -> dict[str, int]:
        """Init torch.distributed + Megatron groups, build the model, load weights, build the optimizer."""
        from transformers import AutoConfig

        if self.settings.cpus:
            pin_process(self.settings.cpus)
        torch.set_num_threads(self.settings.torch_threads)
        self.rendezvous = rendezvous or self.rendezvous
        if self.rendezvous is not None:
            self.rendezvous.export()
        if self.settings.pp_size > 1 and self.settings.critic is not None:
            raise ValueError("a critic needs pp_size 1 (the value model is not pipelined yet)")
        layout = init_parallel(tp_size=self.settings.tp_size, pp_size=self.settings.pp_size, seed=self.settings.seed,
                               store=self._store)
        dtype = torch.bfloat16 if self.settings.bf16 else torch.float32
        lora = self.settings.lora
        # LoRA hooks the local spec's linears (TransformerEngine's fuse the input norm into linear_qkv)
        model = build_gpt_model(AutoConfig.from_pretrained(self.settings.hf_path), params_dtype=dtype,
                                **({"use_te": False} if lora else {}), **self.settings.megatron_args)
        if torch.cuda.is_available():
            model = model.cuda()
        load_hf_checkpoint_into(model, self.settings.hf_path)
        if lora is not None:
            attach_lora(model, lora, seed=self.settings.seed)
        self.bundle = build_optimizer(model, self.settings.optimizer)
        if self.settings.reference and lora is not None and self.settings.reference_path is None:
            pass  # the base under the adapter is the reference (_reference_logprobs)
        elif self.settings.reference:  # same layout (TP shards, PP stages) as the policy, never trained or saved
            ref = build_gpt_model(AutoConfig.from_pretrained(self.settings.hf_path), params_dtype=dtype,
                                  **self.settings.megatron_args)
            if torch.cuda.is_available():
                ref = ref.cuda()
            load_hf_checkpoint_into(ref, self.settings.reference_path or self.settings.hf_path)
            self.reference = ref.eval().requires_grad_(False)
        if self.settings.critic is not None:
            value_model = build_value_model(self.settings.hf_path, params_dtype=dtype,
                                            megatron_args=self.settings.megatron_args,
                                            init_from=self.settings.critic.init_from)
            self.critic = build_optimizer(value_model, self.settings.critic.optimizer)
        return {"rank": layout.rank, "tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank,
                "tp_size": layout.tp_size, "dp_size": layout.dp_size, "pp_rank": layout.pp_rank,
                "pp_size": layout.pp_size}

    def _ready(self) -> OptimizerBundle:
        if self.bundle is None:
            raise RuntimeError("TrainerRank.setup() has not been called")
        return self.bundle

    def train_step(
        self, samples: Sequence[TrainSample], *, ref_logprobs: Sequence[torch.Tensor] | None = None,
        old_logprobs: Sequence[torch.Tensor] | None = None, bump_version: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on the global batch; the policy version advances when weights changed.

        With a reference model and no ``ref_logprobs`` given, they are computed here (the KL term)."""
        if ref_logprobs is None and self.has_reference():
            ref_logprobs = self._reference_logprobs(samples)
        metrics = train_step(self._ready(), samples, self.settings.train,
                             old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
        self.step += 1
        if bump_version and not metrics["step_skipped"]:
            self.policy_version += 1
        metrics.update(step=float(self.step), policy_version=float(self.policy_version))
        return metrics

    def compute_logprobs(self, samples: Sequence[TrainSample], reference: bool = False) -> list[list[float]]:
        """Per-sample token log-probs under the current weights, or the reference model's (plain lists:
        cheap to ship over Ray)."""
        if reference and not self.has_reference():
            raise RuntimeError("this trainer has no reference model (TrainerRankSettings.reference)")
        lps = self._reference_logprobs(samples) if reference else self._logprobs(self._ready().model, samples)
        return [lp.tolist() for lp in lps]

    def compute_logprobs_and_routes(self, samples: Sequence[TrainSample]) -> tuple[list[list[float]],
                                                                                    list[RoutedExperts]]:
        """``compute_logprobs`` under the current weights, with the experts each token was routed to (R2)."""
        train = self.settings.train
        lps, routes = compute_logprobs_and_routes(self._ready().model, samples, temperature=train.temperature,
                                                  max_tokens_per_micro_batch=train.max_tokens_per_micro_batch)
        return [lp.tolist() for lp in lps], routes

    def has_reference(self) -> bool:
        return self.reference is not None or (self.settings.reference and self.settings.lora is not None)

    def _reference_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """The KL reference's log-probs: the frozen reference model's, or a LoRA policy's base (adapter off)."""
        if self.reference is not None:
            return self._logprobs(self.reference, samples)
        model = self._ready().model
        with adapters_disabled(model):
            return self._logprobs(model, samples)

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """The critic's per-token values (aligned to the tokens), as plain lists."""
        train = self.settings.train
        return [v.tolist() for v in compute_values(self._critic().model, samples, train.max_tokens_per_micro_batch,
                                                   train.share_prefixes)]

    def train_critic(self, samples: Sequence[TrainSample], old_values: Sequence[Sequence[float]]) -> dict[str, float]:
        """One critic optimizer step towards the samples' ``returns`` (clipped around ``old_values``)."""
        assert self.settings.critic is not None
        return critic_step(self._critic(), samples, [torch.tensor(v, dtype=torch.float32) for v in old_values],
                           self.settings.critic, self.settings.train.max_tokens_per_micro_batch,
                           self.settings.train.share_prefixes)

    def _critic(self) -> OptimizerBundle:
        if self.critic is None:
            raise RuntimeError("this trainer has no critic (TrainerRankSettings.critic)")
        return self.critic

    def _logprobs(self, model: torch.nn.Module, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        return compute_logprobs(model, samples, temperature=self.settings.train.temperature,
                                max_tokens_per_micro_batch=self.settings.train.max_tokens_per_micro_batch,
                                share_prefixes=self.settings.train.share_prefixes)

    def save_checkpoint(self, path: str) -> str:
        """The policy at ``path``; the critic (if any) beside it at ``path``-critic, written first so a
        policy checkpoint that exists always has its critic; a LoRA policy's adapter also as PEFT loads it, at
        ``path``/adapter (one adapter; the stacked adapters of a per-user job are saved by user by its loop)."""
        if self.critic is not None:
            save_checkpoint(f"{path}-critic", self.critic, step=self.step, policy_version=self.policy_version)
        saved = save_checkpoint(path, self._ready(), step=self.step, policy_version=self.policy_version,
                                portable=self.settings.portable_checkpoints)
        if self.settings.lora is not None and self.settings.lora.adapters == 1:
            self.save_adapter(str(saved / ADAPTER_DIR))  # as PEFT loads it (a per-user job's loop saves each user's)
        return str(saved)

    def load_checkpoint(self, path: str) -> dict[str, int]:
        if self.critic is not None:
            load_checkpoint(f"{path}-critic", self.critic)
        meta: CheckpointMeta = load_checkpoint(path, self._ready())
        self.step, self.policy_version = meta.step, meta.policy_version
        return {"step": self.step, "policy_version": self.policy_version}

    def set_adapter(self, adapter: int, path: str | None = None) -> dict[str, Any]:
        """Adapter ``adapter`` of a multi-adapter trainer becomes the PEFT directory ``path`` with the Adam moments
        and step count saved beside it (None: a fresh adapter, Adam afresh) (collective): a per-user job giving a
        slot to another user."""
        tensors = read_peft_adapter(path)[1] if path is not None else None
        adam = read_slot_adam(path) if path is not None else None
        set_adapter_slot(self._ready(), adapter, tensors, self.settings.seed, adam)
        return {"adapter": adapter, "path": path, "adam": adam is not None}

    def save_adapter(self, path: str, base_model: str | None = None, adapter: int | None = None,
                     with_adam: bool = False) -> str:
        """The LoRA adapter (``adapter`` of a multi-adapter trainer) as a PEFT directory at ``path`` (collective;
        rank 0 writes); ``with_adam``: its Adam moments and step count beside it (a user giving up their slot)."""
        if self.settings.lora is None:
            raise RuntimeError("this trainer has no LoRA adapter (TrainerRankSettings.lora)")
        saved = save_peft_adapter(path, self._ready().model, self.settings.lora,
                                  base_model or self.settings.hf_path, adapter)
        if with_adam and adapter is not None:
            save_slot_adam(saved, self._ready(), adapter)
        return str(saved)

    def named_hf_tensors(self, staging: Staging | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (TP shards all-gathered; with PP > 1 the later stages' streamed to the first)
        for the bucketed weight push (collective); ``staging``: see ``convert.megatron_tensor_to_hf``."""
        yield from pipeline_hf_tensors(self._ready().model, staging)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """``named_hf_tensors`` materialised on CPU (for Ray callers and tests); with PP > 1 every stage's
        tensors, merged on every rank."""
        return gather_stages({name: t.detach().to("cpu", copy=True) for name, t in iter_hf_tensors(self._ready().model)})

    def push_weights(self, engine_urls: Sequence[str], version: int | str,
                     bucket_bytes: int | None = None) -> dict[str, Any]:
        """Bucketed push of the current weights to ``engine_urls`` as ``version`` (collective: every rank
        joins the TP gathers, only the sender rank sends). The pusher and its buffers are kept while the
        engine set and bucket size stay the same, so steady-state pushes reuse their shm buckets."""
        key = (tuple(engine_urls), bucket_bytes or DEFAULT_BUCKET_BYTES)
        if getattr(self, "_pusher_key", None) != key:
            if getattr(self, "_pusher", None) is not None:
                self._pusher.close()
            self._pusher = WeightPusher(list(engine_urls), bucket_bytes=key[1], api_key=self.settings.engine_api_key,
                                        mode=self.settings.weight_sync)
            self._pusher_key = key
        staging = None
        if self._pusher.mode == "tensor" and is_push_sender():
            # the parameters, and what the export converts, in shared memory: the engines copy straight from them
            share_in_place(p.data for p in self._ready().model.parameters())
            if getattr(self, "_staging", None) is None:
                self._staging = SharedStaging()
            staging = self._staging
        return self._pusher.push(self.named_hf_tensors(staging), version=version).model_dump()

    def push_adapter(self, engine_urls: Sequence[str], name: str, adapter: int | None = None) -> dict[str, Any]:
        """Load this job's LoRA adapter (``adapter`` of a multi-adapter trainer) into ``engine_urls`` under the new
        name ``name`` (trainer/adapter_push.py; collective: every rank joins the gathers, only the sender sends)."""
        lora = self.settings.lora
        if lora is None:
            raise RuntimeError("this trainer has no LoRA adapter to push (TrainerRankSettings.lora)")
        tensors = peft_state_dict(self._ready().model, adapter, copy=False)  # the push copies them into its bucket
        if not is_push_sender():
            return {"version": name, "sent": False, "tensors": len(tensors)}
        return self._adapter_pusher(engine_urls).push(name, adapter_config(lora, self.settings.hf_path),
                                                      tensors).model_dump()

    def _adapter_pusher(self, engine_urls: Sequence[str]) -> AdapterPusher:
        key = tuple(engine_urls)
        if getattr(self, "_adapter_key", None) != key:
            if getattr(self, "_adapters", None) is not None:
                self._adapters.close()
            self._adapters = AdapterPusher(key, api_key=self.settings.engine_api_key)
            self._adapter_key = key
        return self._adapters

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this rank runs on (placement checks)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def where(self) -> tuple[str, str, int]:
        """(Ray node, host name, pid) of this rank's process: what cleaning up after it needs."""
        import socket

        return self.node_id(), socket.gethostname(), os.getpid()

    def shutdown(self) -> None:
        """Leave the group and let go of the job: pushers, process groups, the models, the optimizer and the
        shared-memory buffers (a process kept for the next job holds none of this one's)."""
        if getattr(self, "_adapters", None) is not None:
            self._adapters.close()
            self._adapters = None
        if getattr(self, "_pusher", None) is not None:
            self._pusher.close()
            self._pusher = None
        destroy_parallel()
        self.bundle = self.reference = self.critic = None
        self._staging = self._store = None
        self._pusher_key = self._adapter_key = None
        gc.collect()

    def keep_for_later(self) -> tuple[int, int]:
        """After ``shutdown``, before this process waits for another job: its shared-memory files removed (the
        engines may still map the last push's; ``utils/shm.reap_own``); (files, bytes)."""
        return reap_own()

    def reuse(self, settings: TrainerRankSettings) -> int:
        """This process, shut down (``shutdown``) after another job, becomes a fresh rank with ``settings``: as a new
        process starts (cores, torch threads, torch's default seed), ready for ``setup``. Returns the pid."""
        start = self._start
        self.__init__(settings)  # type: ignore[misc]  # every field as a new rank has it
        self._start = start
        start.restore()
        return os.getpid()


class TrainerGroup:
    """``world_size`` TrainerRank Ray actors forming one TP x DP group; calls fan out to all ranks."""

    def __init__(self, settings: TrainerRankSettings, world_size: int, *, num_cpus_per_rank: float = 1.0,
                 num_gpus_per_rank: float = 0.0, resources: dict[str, float] | None = None,
                 registry: str | Path | None = None, on_shutdown: Callable[[], None] | None = None,
                 keep_s: float = 0.0) -> None:
        """``keep_s``: after a clean shutdown the rank processes wait that long, idle, for the next group of
        the same shape, which takes them instead of starting its own (``trainer/warm_ranks.py``); 0: they stop."""
        import ray

        if world_size % (settings.tp_size * settings.pp_size):
            raise ValueError(f"world size {world_size} is not divisible by TP {settings.tp_size} x PP "
                             f"{settings.pp_size}")
        self.world_size = world_size
        self.keep_s = keep_s
        # the Ray cluster (a node id is new with every start) and what each rank reserves in it
        self.shape = (ray.get_runtime_context().get_node_id(), world_size, num_cpus_per_rank, num_gpus_per_rank,
                      tuple(sorted((resources or {}).items())))
        self.reused = False
        self._closed = False
        self._ranks: list[tuple[str, str, int]] = []  # (node id, host, pid) of every rank once set up: shutdown
        # reaps them. Where the ranks are recorded while they run (utils/shm.record_ranks): a server killed before
        # it could shut them down leaves their buckets in /dev/shm, and the next one on the host removes them
        self.registry = Path(registry) if registry is not None else None
        self._on_shutdown = on_shutdown  # once, at the first shutdown (the launcher gives the cores back)
        warm = WARM.take(self.shape)
        if warm is not None:
            try:
                ray.get([a.reuse.remote(settings) for a in warm.actors], timeout=60)
                self.actors, self._ranks, self.reused = warm.actors, warm._ranks, True
            except Exception:  # noqa: BLE001 - a rank that died while it waited: start afresh
                log.warning("idle trainer ranks could not be reused; starting new ones", exc_info=True)
                warm.stop()
        if not self.reused:
            remote_cls = ray.remote(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                                    resources=dict(resources or {}) or None)(TrainerRank)
            self.actors = [remote_cls.remote(settings) for _ in range(world_size)]

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def setup(self) -> list[dict[str, int]]:
        """Rendezvous at rank 0's node (its IP, the port its store bound), then set every rank up."""
        import ray

        ip, port = ray.get(self.actors[0].open_rendezvous.remote(self.world_size))
        self._ranks = [(str(node), str(host), int(pid)) for node, host, pid in self._all("where")]
        if self.registry is not None:
            record_ranks(self.registry, [(host, pid) for _, host, pid in self._ranks])
        return ray.get([
            a.setup.remote(RendezvousInfo(rank=r, world_size=self.world_size, master_addr=ip, master_port=port))
            for r, a in enumerate(self.actors)
        ])

    def train_step(self, samples: Sequence[TrainSample], **kwargs: Any) -> dict[str, float]:
        return self._all("train_step", list(samples), **kwargs)[0]

    def compute_logprobs(self, samples: Sequence[TrainSample], reference: bool = False) -> list[list[float]]:
        return self._all("compute_logprobs", list(samples), reference)[0]

    def compute_logprobs_and_routes(self, samples: Sequence[TrainSample]) -> tuple[list[list[float]],
                                                                                    list[RoutedExperts]]:
        return self._all("compute_logprobs_and_routes", list(samples))[0]

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        return self._all("compute_values", list(samples))[0]

    def train_critic(self, samples: Sequence[TrainSample], old_values: Sequence[Sequence[float]]) -> dict[str, float]:
        return self._all("train_critic", list(samples), [list(v) for v in old_values])[0]

    def alive(self, timeout: float = 10.0) -> bool:
        """Whether every rank process still answers (a rank that died makes this False)."""
        import ray

        try:
            ray.get([a.pid.remote() for a in self.actors], timeout=timeout)
        except Exception:  # noqa: BLE001 - RayActorError, GetTimeoutError: a rank is gone or hung
            return False
        return True

    def save_checkpoint(self, path: str | Path) -> str:
        return self._all("save_checkpoint", str(path))[0]

    def load_checkpoint(self, path: str | Path) -> dict[str, int]:
        return self._all("load_checkpoint", str(path))[0]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self._all("hf_state_dict")[0]

    def push_weights(self, engine_urls: Sequence[str], version: int | str,
                     bucket_bytes: int | None = None) -> dict[str, Any]:
        """The sender rank's push stats (raises the sender's ``WeightPushError``)."""
        return next(r for r in self._all("push_weights", list(engine_urls), version, bucket_bytes) if r["sent"])

    def push_adapter(self, engine_urls: Sequence[str], name: str, adapter: int | None = None) -> dict[str, Any]:
        return next(r for r in self._all("push_adapter", list(engine_urls), name, adapter) if r["sent"])

    def save_adapter(self, path: str, base_model: str | None = None, adapter: int | None = None,
                     with_adam: bool = False) -> str:
        return self._all("save_adapter", path, base_model, adapter, with_adam)[0]

    def set_adapter(self, adapter: int, path: str | None = None) -> dict[str, Any]:
        return self._all("set_adapter", adapter, path)[0]

    def node_ids(self) -> list[str]:
        """The Ray node of every rank."""
        return self._all("node_id")

    def pids(self) -> list[int]:
        """OS pids of the rank processes (for health checks and fault tests)."""
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def shutdown(self, timeout: float = 30.0) -> None:
        """Every rank lets go of the job; then, when all did and ``keep_s`` says so, the processes wait for the
        next group of this shape, else they stop (a rank already dead, killed or crashed, is only reaped). Once."""
        import ray

        if self._closed:
            return
        self._closed = True
        refs = [a.shutdown.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        clean = len(ready) == len(refs) and self.keep_s > 0
        if clean:
            try:
                ray.get(ready)
                ray.get([a.keep_for_later.remote() for a in self.actors], timeout=timeout)
            except Exception:  # noqa: BLE001 - a rank that failed to let go (or is dead) is not kept
                clean = False
        if clean:
            WARM.put(self.shape, self, self.stop, self.keep_s)
        else:
            self.stop()
        done, self._on_shutdown = self._on_shutdown, None
        if done is not None:
            done()

    def stop(self) -> None:
        """End the rank processes and remove what they leave in shared memory."""
        import ray

        for a in self.actors:
            ray.kill(a)
        self.reap_shared_memory()

    def reap_shared_memory(self, wait_s: float = 10.0) -> tuple[int, int]:
        """Remove the weight buckets (``/dev/shm/torch_<pid>_*``) of this group's rank processes once they are
        dead, on every node they ran on (``utils/shm.py`` says why torch leaves them); (files, bytes)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        by_node: dict[str, list[int]] = {}
        for node, _, pid in self._ranks:
            by_node.setdefault(node, []).append(pid)
        removed = freed = 0
        for node, pids in by_node.items():
            try:
                if node == here:
                    n, b = reap_dead_pids(pids, wait_s)
                else:
                    task = ray.remote(num_cpus=0)(reap_dead_pids).options(
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                    n, b = ray.get(task.remote(pids, wait_s), timeout=wait_s + 30)
            except Exception:  # noqa: BLE001 - a node that is gone took its files with it; never fail a shutdown
                log.warning("could not reap the shared memory of trainer ranks %s on node %s", pids, node,
                            exc_info=True)
                continue
            removed, freed = removed + n, freed + b
        if removed:
            log.info("removed %d shared-memory files (%.1f MB) of dead trainer ranks", removed, freed / 1e6)
        if self.registry is not None:
            forget_ranks(self.registry, [(host, pid) for _, host, pid in self._ranks])
        self._ranks = []
        return removed, freed
