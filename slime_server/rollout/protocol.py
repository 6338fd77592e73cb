"""Pydantic models of SGLang's native HTTP wire formats (the subset the router, gateway and trainer use).

Why: every layer above the engine speaks this protocol, so a real SGLang server must drop in with no
other change. Field names and defaults follow SGLang's ``io_struct.GenerateReqInput``,
``sampling_params.SamplingParams`` and the ``meta_info`` built by its ``tokenizer_manager``.
Unknown fields are ignored (as SGLang ignores them), wrong types are refused with a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# SGLang's default when max_new_tokens is not given.
DEFAULT_MAX_NEW_TOKENS = 128
MAX_N = 64
MAX_TOP_LOGPROBS = 100
SAMPLING_EPS = 1e-6  # temperatures below this are greedy (SGLang's _SAMPLING_EPS)


class _Lenient(BaseModel):
    """Wire models ignore unknown keys, like SGLang's dataclasses built with ``**kwargs`` filtering."""

    model_config = ConfigDict(extra="ignore")


# SGLang 0.5.23's sampling keys the CPU engine does not implement, with the value that means "off": a
# request that sets one to anything else gets a clear 400 instead of a silently different sample.
UNSUPPORTED_SAMPLING: dict[str, Any] = {
    "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "logit_bias": None, "custom_params": None, "beam_width": None, "watermark": None, "choice": None,
}


class SamplingParams(BaseModel):
    """SGLang ``sampling_params``. temperature 0 (or below SAMPLING_EPS) is greedy (SGLang: top_k=1).

    Unknown keys are refused, as SGLang 0.5.23's contract refuses them (``seed`` is not SGLang's
    spelling: ``sampling_seed`` is); SGLang keys this engine does not implement are refused unless
    they hold their neutral value (``UNSUPPORTED_SAMPLING``).
    """

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 (or 0) disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: int | None = Field(DEFAULT_MAX_NEW_TOKENS, ge=0,
                                       description="null: up to the context length (as SGLang)")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    sampling_seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # SGLang's verify(): a signed int64
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = Field(None, ge=1)
    stop_regex: Any = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    json_schema: str | None = Field(None, description="constrain the output to this JSON schema (text); "
                                    "$$ANY$$: any JSON value (rollout/grammar.py)")
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: Any = None
    custom_params: Any = None
    beam_width: Any = None
    watermark: Any = None
    choice: Any = None

    model_config = ConfigDict(extra="forbid")

    @field_validator("json_schema", "regex", "ebnf", "structural_tag")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None  # SGLang's normalisation: an empty grammar is none

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingParams:
        if sum(g is not None for g in (self.json_schema, self.regex, self.ebnf, self.structural_tag)) > 1:
            raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")  # SGLang's words
        return self

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> SamplingParams:
        for key, neutral in UNSUPPORTED_SAMPLING.items():
            value = getattr(self, key)
            if value is not None and value != neutral and value != [] and value != {}:
                raise ValueError(f"{key} is not supported by this engine (only {neutral!r})")
        return self

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, v: float) -> float:
        # as SGLang (_SAMPLING_EPS): logits / 1e-40 overflow to inf and the sampler would see NaN
        return 0.0 if v < SAMPLING_EPS else v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class GenerateReqInput(_Lenient):
    """Body of ``POST /generate``: one prompt or a batch (``input_ids`` list of lists / ``text`` list)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = Field(0)
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | None | list[str | None] = Field(None, description="the LoRA adapter's NAME (SGLang's field "
                                                     "name): one for every prompt, or one per prompt; None: the base")
    return_routed_experts: bool = Field(False, description="an MoE model's routed experts in the final meta_info "
                                        "(servers started with --enable-return-routed-experts)")
    routed_experts_start_len: int = Field(0, description="SGLang's: the routes returned cover positions "
                                          "[routed_experts_start_len, seqlen - 1); in [0, prompt tokens]")
    image_data: str | list[str] | list[list[str]] | None = Field(
        None, description="SGLang's: images of a vision-language prompt, in prompt order, each a data URL or "
        "base64 (input_ids hold one <|vision_start|><|image_pad|><|vision_end|> per image); a batch: one list a prompt")
    return_prompt_token_ids: bool = Field(False, description="SGLang's: the answer carries the prompt's ids as the "
                                          "engine ran them (images' pads expanded)")

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _none_is_default(cls, v: Any) -> Any:
        return {} if v is None else v

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' or 'input_ids' must be given")
        return self

    @property
    def is_batch(self) -> bool:
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)


class FinishReason(BaseModel):
    """SGLang's ``finish_reason``: stop (matched token id or string), length, or abort."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None


LogprobEntry = tuple[float | None, int, str | None]


class WeightVersionSpan(BaseModel):
    """SGLang's ``{version, start, end}``: output tokens ``[start, end)`` came from weights ``version``."""

    version: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)

    @field_validator("version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v)


class MetaInfo(BaseModel):
    """``meta_info`` of one generation, as SGLang's tokenizer manager fills it.

    Also parses real SGLang answers: keys we do not model are kept (``extra="allow"``), and fields SGLang
    sends only sometimes (``e2e_latency`` is only on the final chunk) are optional.
    """

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    # SGLang's spans: output tokens [start, end) were produced by weights ``version``. Several spans only
    # for a request that was in flight while a weight update was applied.
    weight_versions: list[WeightVersionSpan] | None = None
    # SGLang's routed experts (MoE, final output only): base64 of little-endian int32 [seqlen - 1 - start_len,
    # num_hidden_layers, top-k], seqlen = prompt + output tokens (the last output token was never run)
    routed_experts: str | None = None
    image_tokens: int | None = None  # SGLang's: the prompt's image pad tokens (sent only when > 0)

    def token_versions(self, n: int) -> list[str]:
        """The weight version of each of the first ``n`` output tokens (from the spans; without spans,
        ``weight_version`` for all: a server that reports no spans ran one version per request)."""
        if not self.weight_versions:
            return [self.weight_version or ""] * n
        out: list[str] = []
        for span in self.weight_versions:
            out += [span.version] * (max(span.end, span.start) - span.start)
        if len(out) < n:  # the last span runs to the end (a stream chunk may report it before its end)
            out += [self.weight_versions[-1].version] * (n - len(out))
        return out[:n]


class GenerateOutput(BaseModel):
    """One result of ``POST /generate`` (a list of these for batch input or n > 1)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None
    prompt_token_ids: list[int] | None = None  # SGLang's, with return_prompt_token_ids: the expanded prompt

    def wire(self) -> dict[str, Any]:
        """JSON dict with optional-but-absent logprob fields dropped, as SGLang omits them."""
        d = self.model_dump(exclude_none=False)
        if self.index is None:
            d.pop("index")
        if self.prompt_token_ids is None:
            d.pop("prompt_token_ids")
        mi = d["meta_info"]
        for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs",
                    "input_top_logprobs", "weight_versions", "e2e_latency", "routed_experts", "image_tokens"):
            if mi.get(key) is None:
                mi.pop(key, None)
        fr = mi["finish_reason"]
        if fr is not None:
            mi["finish_reason"] = {k: v for k, v in fr.items() if v is not None or k == "matched"}
            if fr["type"] != "stop":
                mi["finish_reason"].pop("matched", None)
        return d


class AbortReq(_Lenient):
    """SGLang ``AbortReq``: one request by its exact ``rid`` (the gateway's per-sample ``{rid}_{i}`` and
    continuation ``-cont{k}`` requests are separate rids: it aborts each), or everything with ``abort_all``."""

    rid: str | None = None
    abort_all: bool = False


PauseMode = Literal["abort", "retract", "in_place"]


class PauseGenerationReqInput(_Lenient):
    """SGLang's modes: ``abort`` aborts running requests; ``retract`` puts them back in the queue (their KV
    is dropped and recomputed after ``/continue_generation``); ``in_place`` freezes them with their KV."""

    mode: PauseMode = "abort"


class ContinueGenerationReqInput(_Lenient):
    torch_empty_cache: bool = True


class _WeightVersioned(_Lenient):
    weight_version: str | None = None

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return None if v is None else str(v)


class UpdateWeightFromDiskReqInput(_WeightVersioned):
    """Body of ``POST /update_weights_from_disk`` (SGLang's ``UpdateWeightFromDiskReqInput``)."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(_Lenient):
    """Body of ``POST /init_weights_update_group``: the engine joins as rank ``rank_offset + tp_rank`` of a
    ``world_size`` group whose rank 0 (the trainer) listens at ``master_address:master_port``."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Lenient):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(_WeightVersioned):
    """Body of ``POST /update_weights_from_distributed``: the tensors that rank 0 broadcasts next, in order
    (one flat uint8 tensor in SGLang's contiguous layout with ``load_format="flattened_bucket"``)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None


class UpdateWeightsFromTensorReqInput(_WeightVersioned):
    """Body of ``POST /update_weights_from_tensor``: one ``MultiprocessingSerializer`` payload (base64) per
    engine TP rank; tensors travel by reference (CUDA IPC on GPU, shared memory on CPU)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


# Every engine route our code calls: (HTTP method, path, request body model or None). The contract test
# checks each against the pinned SGLang release's own source; a route or a field we invent fails it.
class LoadLoRAAdapterReqInput(_Lenient):
    """SGLang's ``/load_lora_adapter`` body: a PEFT directory loaded under a new name."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterReqInput(_Lenient):
    lora_name: str


class LoadLoRAAdapterFromTensorsReqInput(_Lenient):
    """SGLang's ``/load_lora_adapter_from_tensors`` body: an adapter's PEFT config and tensors under a new name, no
    file. ``serialized_named_tensors``: one ``MultiprocessingSerializer`` payload (base64) per engine TP rank, a
    ``{name: tensor}`` dict or (``load_format="flattened_bucket"``) one flat bucket; ``expected_checksums``: PEFT
    name -> sha256 of each tensor's bytes, checked before anything loads."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class LoRAUpdateOutput(BaseModel):
    """SGLang's answer to a LoRA load or unload (200 on success, 400 on failure): ``loaded_adapters`` maps every
    loaded name to its path (None when the request failed before reaching the adapters)."""

    rid: str | None = None
    http_worker_ipc: str | None = None
    success: bool
    error_message: str | None = ""
    loaded_adapters: dict[str, str] | None = None


SGLANG_ROUTES: list[tuple[str, str, type[BaseModel] | None]] = [
    ("POST", "/generate", GenerateReqInput),
    ("GET", "/health", None),
    ("GET", "/health_generate", None),
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    ("GET", "/flush_cache", None),
    ("POST", "/abort_request", AbortReq),
    ("POST", "/pause_generation", PauseGenerationReqInput),
    ("POST", "/continue_generation", ContinueGenerationReqInput),
    ("POST", "/update_weights_from_disk", UpdateWeightFromDiskReqInput),
    ("POST", "/init_weights_update_group", InitWeightsUpdateGroupReqInput),
    ("POST", "/update_weights_from_distributed", UpdateWeightsFromDistributedReqInput),
    ("POST", "/destroy_weights_update_group", DestroyWeightsUpdateGroupReqInput),
    ("POST", "/update_weights_from_tensor", UpdateWeightsFromTensorReqInput),
    ("POST", "/load_lora_adapter", LoadLoRAAdapterReqInput),
    ("POST", "/unload_lora_adapter", UnloadLoRAAdapterReqInput),
    ("POST", "/load_lora_adapter_from_tensors", LoadLoRAAdapterFromTensorsReqInput),
]


class LoadSnapshot(_Lenient):
    """One data-parallel rank's load in SGLang's ``/v1/loads`` (``managers/load_snapshot.LoadSnapshot``, the
    core fields we read; SGLang sends more, ignored)."""

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    max_running_requests: int = 0
    max_total_num_tokens: int = 0


class LoadsResponse(_Lenient):
    """SGLang 0.5.23's ``GET /v1/loads`` (``entrypoints/v1_loads.py``): per-rank loads and who answers."""

    timestamp: str
    version: str
    accelerator: str | None = None
    num_accelerators: int = 0
    loads: list[LoadSnapshot]


class UpdateWeightsResult(BaseModel):
    """SGLang's response shape for every weight-update endpoint (``num_paused_requests``: disk only)."""

    success: bool
    message: str
    num_paused_requests: int | None = None


class ErrorBody(BaseModel):
    """SGLang's error body: ``{"error": {"message": ...}}`` plus OpenAI-style ``object``/``code``."""

    class Detail(BaseModel):
        message: str
        type: str = "BadRequestError"
        code: int = 400

    object: Literal["error"] = "error"
    error: Detail


def version_spans(versions: list[str], current: str) -> list[WeightVersionSpan]:
    """SGLang's ``weight_versions``: runs of equal versions over the output tokens, ``[start, end)``; no
    output yet is one empty span of the current version. ``weight_version`` is the last span's."""
    spans: list[WeightVersionSpan] = []
    for i, v in enumerate(versions):
        if spans and spans[-1].version == v:
            spans[-1].end = i + 1
        else:
            spans.append(WeightVersionSpan(version=v, start=i, end=i + 1))
    return spans or [WeightVersionSpan(version=current, start=0, end=0)]
