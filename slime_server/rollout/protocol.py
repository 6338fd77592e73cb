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


class SamplingParams(_Lenient):
    """SGLang ``sampling_params``. temperature 0 (or below SAMPLING_EPS) is greedy (SGLang: top_k=1)."""

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
    seed: int | None = Field(None, ge=0, le=2**63 - 1, alias="sampling_seed")
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

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

    @model_validator(mode="before")
    @classmethod
    def _accept_seed_alias(cls, data: Any) -> Any:
        # SGLang calls it ``sampling_seed``; ``seed`` is the OpenAI-side spelling. Accept both.
        if isinstance(data, dict) and "seed" in data and "sampling_seed" not in data:
            data = {**data, "sampling_seed": data["seed"]}
        return data

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
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


LogprobEntry = tuple[float | None, int, str | None]


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
    # Extension (not in SGLang): the policy version that produced each output token. It differs from
    # ``weight_version`` only for requests that were in flight while a weight update was committed.
    output_token_weight_versions: list[str] | None = None


class GenerateOutput(BaseModel):
    """One result of ``POST /generate`` (a list of these for batch input or n > 1)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None

    def wire(self) -> dict[str, Any]:
        """JSON dict with optional-but-absent logprob fields dropped, as SGLang omits them."""
        d = self.model_dump(exclude_none=False)
        if self.index is None:
            d.pop("index")
        mi = d["meta_info"]
        for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs",
                    "input_top_logprobs", "output_token_weight_versions", "e2e_latency"):
            if mi.get(key) is None:
                mi.pop(key, None)
        fr = mi["finish_reason"]
        if fr is not None:
            mi["finish_reason"] = {k: v for k, v in fr.items() if v is not None or k == "matched"}
            if fr["type"] != "stop":
                mi["finish_reason"].pop("matched", None)
        return d


class AbortReq(_Lenient):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReq(_Lenient):
    """SGLang's modes: ``abort`` (default) aborts running requests; ``in_place``/``retract`` keep them."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsFromDiskReq(_Lenient):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return None if v is None else str(v)


class UpdateWeightsResult(BaseModel):
    """SGLang's response shape for every weight-update endpoint."""

    success: bool
    message: str
    num_paused_requests: int = 0
    weight_version: str | None = None


class ErrorBody(BaseModel):
    """SGLang's error body: ``{"error": {"message": ...}}`` plus OpenAI-style ``object``/``code``."""

    class Detail(BaseModel):
        message: str
        type: str = "BadRequestError"
        code: int = 400

    object: Literal["error"] = "error"
    error: Detail
