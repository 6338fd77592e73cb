"""Bring up the rollout side: Ray, N engine actors, the sgl-router, and the workers registered in it.

``Deployment`` is the one handle the CLI, the gateway and the trainer hold: it knows the router URL
and every engine URL, grows and shrinks the engine pool at run time, and tears everything down
(engines first, then the router, then Ray if it started it) so nothing outlives it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slime_server.config import EngineSettings, ServerSettings, SetupError, TrainerSettings
from slime_server.demo_learning import WARM_START_MODEL, calculator_warm_start
from slime_server.models.registry import MODELS, fetch_model
from slime_server.models.tiny import ensure_tiny_model
from slime_server.rollout.actors import EngineActor, EngineSpec, EngineStatus, log_path_for, lora_args
from slime_server.rollout.engine_auth import engine_key
from slime_server.rollout.router import RouterProcess
from slime_server.server.core_share import CoreShare
from slime_server.server.local_ray import start_local_ray
from slime_server.trainer.settings import LossConfig
from slime_server.trainer.warm_ranks import WARM

log = logging.getLogger(__name__)


def resolve_model_path(model: str) -> str:
    """``"tiny"`` -> the cached built-in tiny model; ``"tiny-calc"`` -> its calculator warm start (built once,
    cached); a registry name (``"smollm2"``) that is not a local path ->
    its converted directory (fetched once); anything else is used as given."""
    if model == "tiny":
        return str(ensure_tiny_model())
    if model == WARM_START_MODEL:  # the demo's warm start: a tiny model that already earns calculator reward
        return str(calculator_warm_start())

    if model in MODELS and not Path(model).exists():
        return str(fetch_model(model))
    return model


def ray_cpus_needed(settings: ServerSettings) -> int:
    """Ray CPU resources the engines and (unless colocated) the trainer ranks reserve."""
    eng, tr = settings.engine, settings.trainer
    return math.ceil(eng.num_engines * eng.num_cpus_per_engine
                     + (0 if tr.colocate else tr.num_ranks * tr.num_cpus_per_rank))


class RayAuthError(SetupError):
    """The Ray cluster wants a token this process does not have (or has a different one)."""


def use_ray_token(token_file: str | None) -> None:
    """Make this process (and the Ray workers it starts) present the cluster's token: Ray reads
    ``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN_PATH`` from the environment when it connects."""
    if token_file is None:
        return
    path = Path(token_file).expanduser()
    if not path.is_file() or not path.read_text().strip():
        raise RayAuthError(f"ray.auth_token_file {path} is missing or empty (make one with "
                           "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE`, chmod 600)")
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path.resolve())
    # Ray read its config when it was imported: re-read it, as Ray's own token setup does
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def check_ray_auth(address: str) -> None:
    """Fail fast, naming the fix, when the cluster at ``address`` refuses this process's token (or lack of
    one); ``ray.init`` itself retries for ~20 s and then blames a crashed cluster."""
    if address == "auto" or "://" in address:
        return
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        GcsClient(address=address).internal_kv_get(b"slime-server-auth-probe", b"", timeout=10)
    except AuthenticationError as e:
        has = os.environ.get("RAY_AUTH_MODE") == "token"
        why = ("the token this server presents is not the cluster's" if has else
               "it runs with RAY_AUTH_MODE=token and this server has no token")
        raise RayAuthError(
            f"the Ray cluster at {address} refused this server's token: {why}. Give this server the cluster's "
            "token file: --ray-auth-token-file FILE (or SLIME_RAY__AUTH_TOKEN_FILE), the file every Ray node "
            "was started with (RAY_AUTH_TOKEN_PATH)") from e
    except Exception:  # noqa: BLE001 - unreachable, timed out, ...: ray.init reports those in its own words
        return


def _init_ray(settings: ServerSettings) -> bool:
    """Start (or join) Ray; returns True when this call started it and so must shut it down."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    use_ray_token(settings.ray.auth_token_file)
    common: dict[str, Any] = dict(namespace=settings.ray.namespace, log_to_driver=False,
                                  include_dashboard=False, configure_logging=False)
    # Ray's core worker installs its own SIGTERM handler (log + re-raise: exit 143, no cleanup);
    # keep whatever the caller installed so shutdown stays in the caller's hands.
    main_thread = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    if settings.ray.address:
        check_ray_auth(settings.ray.address)
        ray.init(address=settings.ray.address, **common)
    else:
        # no ray.address: a Ray of our own, without what only a shared cluster uses (server/local_ray.py)
        start_local_ray(settings.ray.num_cpus or max(os.cpu_count() or 1, ray_cpus_needed(settings), 1), **common)
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)
    return True


class Deployment:
    """Running engines + router. Use ``Deployment.start(settings)``; always ``shutdown()``."""

    def __init__(self, settings: ServerSettings, log_dir: str | Path | None = None,
                 actor_cls: type[EngineActor] = EngineActor) -> None:
        self.settings = settings
        self.actor_cls = actor_cls
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="slime-server-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.model_path = resolve_model_path(settings.engine.model)
        if settings.engine.sglang_args and settings.engine.kind != "sglang":
            log.warning("engine.kind is %r: ignoring sglang_args %s", settings.engine.kind,
                        sorted(settings.engine.sglang_args))
        eng = settings.engine
        self.engine_api_key = engine_key(eng.host, eng.api_key, eng.insecure)
        if self.engine_api_key and not eng.api_key:
            key_file = self.log_dir / "engine_api_key"
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, self.engine_api_key.encode())
            finally:
                os.close(fd)
            log.warning("engines listen on %s: generated their API key (in %s)", eng.host, key_file)
        self.router = RouterProcess(settings.router, log_path=log_path_for(self.log_dir, "router"),
                                    api_key=self.engine_api_key)
        self._actors: dict[str, Any] = {}  # url -> Ray actor handle
        self.cores = CoreShare(eng, settings.trainer, local=settings.ray.address is None)
        self._owns_ray = False
        self._next_index = 0
        self._lock = threading.RLock()  # the gateway/trainer may grow or shrink the pool from threads

    @classmethod
    def start(cls, settings: ServerSettings, log_dir: str | Path | None = None,
              actor_cls: type[EngineActor] = EngineActor) -> Deployment:
        """Ray up, router up, ``settings.engine.num_engines`` engines up and registered."""
        dep = cls(settings, log_dir, actor_cls)
        try:
            dep._owns_ray = _init_ray(settings)
            dep.router.start()
            dep.add_engines(settings.engine.num_engines)
        except BaseException:
            dep.shutdown()
            raise
        return dep

    @property
    def router_url(self) -> str:
        return self.router.url

    @property
    def engine_urls(self) -> list[str]:
        return list(self._actors)

    def _spec(self, engine: EngineSettings, cpus: list[int] | None) -> EngineSpec:
        with self._lock:
            name = f"engine-{self._next_index}"
            self._next_index += 1
        return EngineSpec(
            kind=engine.kind, model_path=self.model_path, host=engine.host, api_key=self.engine_api_key,
            insecure=engine.insecure, max_running_requests=engine.max_running_requests,
            torch_threads=engine.torch_threads or 0, cpus=cpus if cpus is not None else engine.cpus,
            cpu_forward=engine.cpu_forward, prefix_cache_mb=engine.prefix_cache_mb, lora=lora_args(engine),
            sglang_args=engine.sglang_args, startup_timeout_s=engine.startup_timeout_s,
            health_interval_s=engine.health_interval_s, log_path=log_path_for(self.log_dir, name),
        )

    def add_engines(self, n: int) -> list[str]:
        """Start ``n`` engines in parallel, register each with the router; returns their URLs."""
        import ray

        eng = self.settings.engine
        gpus = eng.num_gpus_per_engine if eng.kind == "sglang" else 0
        remote_cls = ray.remote(self.actor_cls).options(num_cpus=eng.num_cpus_per_engine, num_gpus=gpus,
                                                      resources=dict(eng.ray_resources) or None, max_concurrency=4)
        with self._lock:
            shares = self.cores.engine_cores(len(self._actors) + n)
        new_shares = shares[-n:] if shares else [None] * n
        actors = [remote_cls.remote(self._spec(eng, cpus)) for cpus in new_shares]
        try:
            urls = ray.get([a.url.remote() for a in actors], timeout=eng.startup_timeout_s + 30)
        except BaseException:
            for a in actors:
                _stop_actor(a)
            raise
        for url, actor in zip(urls, actors, strict=True):
            with self._lock:
                self._actors[url] = actor
            self.router.add_worker(url)
        self.share_cores()
        return urls

    def share_cores(self) -> None:
        """Move the local CPU engines onto their default cores now (``server/core_share.py``)."""
        import ray

        with self._lock:
            actors = list(self._actors.values())
            shares = self.cores.engine_cores(len(actors))
        if shares:
            ray.get([a.set_cpus.remote(cpus) for a, cpus in zip(actors, shares, strict=True)], timeout=60)

    def begin_training(self) -> tuple[list[int] | None, int | None]:
        """A job's ranks are starting: the engines move off the ranks' default cores; (cores, threads) for the
        ranks (None: the trainer settings decide). Pair with ``end_training``."""
        with self._lock:
            self.cores.training += 1
        self.share_cores()
        return self.cores.trainer_cores(), self.cores.trainer_threads()

    def end_training(self) -> None:
        """A job's ranks are gone: the engines get the cores back once no job trains."""
        with self._lock:
            self.cores.training = max(0, self.cores.training - 1)
        self.share_cores()

    def add_engine(self) -> str:
        return self.add_engines(1)[0]

    def remove_engine(self, url: str | None = None) -> str:
        """Deregister from the router first (no new traffic), then stop the engine. Default: newest."""
        with self._lock:
            if not self._actors:
                raise KeyError("no engines to remove")
            url = url or list(self._actors)[-1]
            if url not in self._actors:
                raise KeyError(f"no engine at {url}")
            actor = self._actors.pop(url)
        self.router.remove_worker(url)
        _stop_actor(actor)
        self.share_cores()
        return url

    def engine_status(self) -> list[EngineStatus]:
        import ray

        return ray.get([a.status.remote() for a in self._actors.values()])

    def restart_engine(self, url: str) -> str:
        """Kill and restart the engine at ``url`` on the same port (the router keeps its entry)."""
        import ray

        return ray.get(self._actors[url].restart.remote())

    def actor(self, url: str) -> Any:
        """The Ray actor handle owning the engine at ``url`` (for restart/status calls)."""
        return self._actors[url]

    def shutdown(self) -> None:
        """Stop idle trainer ranks and engines, then the router, then Ray if we started it. Safe to call twice."""
        with self._lock:
            actors, self._actors = list(self._actors.values()), {}
        WARM.clear()  # idle trainer ranks go with the engines
        for actor in actors:
            _stop_actor(actor)
        self.router.close()
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _stop_actor(actor: Any) -> None:
    import ray

    try:
        ray.get(actor.stop.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - the actor may already be dead; kill it regardless
        pass
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - Ray itself may be gone (Ctrl-C reached its processes too)
        pass


def warm_ranks_s(trainer: TrainerSettings) -> float:
    """How long a finished job's ranks wait for the next job (``trainer.warm_ranks_s``; unset: 300 s on CPU, none
    on GPU)."""
    if trainer.warm_ranks_s is not None:
        return trainer.warm_ranks_s
    return 0.0 if trainer.num_gpus_per_rank else 300.0


def rank_registry(trainer: TrainerSettings) -> Path:
    """Where running trainer ranks are recorded (``utils/shm.record_ranks``): under the jobs' work dir."""
    return Path(trainer.work_dir) / ".ranks"


def start_trainer_group(model_path: str, trainer: TrainerSettings, *, optimizer: Any, loss: dict[str, Any],
                        temperature: float = 1.0, max_tokens_per_micro_batch: int | None = None,
                        engine_api_key: str | None = None, reference: bool = False, critic: Any = None,
                        reference_path: str | None = None, cores: tuple[list[int] | None, int | None] = (None, None),
                        on_shutdown: Callable[[], None] | None = None, lora: Any = None) -> Any:
    """Megatron-core ranks for one job as Ray actors (TP x PP x DP over gloo on CPU, nccl on GPU), set up.

    Colocated ranks reserve no CPU of their own: they share the engines' share and the loop pauses
    generation while they step and push. ``cores`` (``Deployment.begin_training``) is where the ranks run and
    their threads when the trainer settings leave both open; ``on_shutdown`` runs once the group is shut down
    (``Deployment.end_training``), and if it fails to set up.
    """
    from slime_server.trainer.actor import TrainerGroup, TrainerRankSettings  # lazy: loads torch
    from slime_server.trainer.train_step import TrainStepSettings  # lazy: loads torch

    rank_settings = TrainerRankSettings(
        hf_path=model_path, tp_size=trainer.tp_size, pp_size=trainer.pp_size, optimizer=optimizer,
        torch_threads=trainer.torch_threads or cores[1] or 1, cpus=trainer.cpus or cores[0],
        train=TrainStepSettings(temperature=temperature, loss=LossConfig(**loss),
                                max_tokens_per_micro_batch=max_tokens_per_micro_batch
                                or trainer.max_tokens_per_micro_batch, share_prefixes=trainer.share_prefixes),
        megatron_args=trainer.megatron_args, engine_api_key=engine_api_key, weight_sync=trainer.weight_sync,
        reference=reference, reference_path=reference_path, critic=critic, lora=lora)
    try:
        group = TrainerGroup(rank_settings, trainer.num_ranks,
                             num_cpus_per_rank=0.0 if trainer.colocate else trainer.num_cpus_per_rank,
                             num_gpus_per_rank=trainer.num_gpus_per_rank, resources=trainer.ray_resources,
                             registry=rank_registry(trainer), on_shutdown=on_shutdown, keep_s=warm_ranks_s(trainer))
    except BaseException:  # no group to shut down: give its cores back here
        if on_shutdown is not None:
            on_shutdown()
        raise
    try:
        group.setup()
    except BaseException:
        group.shutdown()
        raise
    return group
