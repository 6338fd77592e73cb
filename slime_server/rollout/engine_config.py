"""The CPU engine's knobs (``EngineConfig``): its CLI flags (``rollout/engine_server.py``, SGLang's names where
SGLang has the knob) map onto these one to one."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class EngineConfig(BaseModel):
    """Engine knobs; the CLI flags map onto these one to one."""

    model_path: str
    max_running_requests: int = Field(32, ge=1)
    max_total_tokens: int | None = Field(None, ge=1, description="KV tokens reserved by running requests")
    context_length: int | None = Field(None, ge=1, description="default: config.max_position_embeddings")
    weight_version: str = "0"
    seed: int = 0
    num_threads: int = Field(0, ge=0, description="torch threads; 0: one per core the engine may run on, "
                             "followed as serve moves it (rollout/core_follow.py)")
    forward: Literal["lean", "hf"] = Field("lean", description="lean: the engine's own forward over the model's "
                                           "parameters (llama/mistral/qwen2/qwen3; others use HF's); hf: HF's "
                                           "model() with a cache rebuilt per step (the reference)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights, activations and K/V; bfloat16 "
                                                  "halves the memory read per token (log-probs are still fp32)")
    decode_kernel: Literal["c", "torch"] = Field("c", description="c: the decode step's matmuls through gemv.c, "
                                                 "built for this CPU on first use (torch's where no C compiler "
                                                 "builds it); torch: torch's kernels throughout (the reference)")
    prefix_cache_mb: float = Field(512.0, ge=0, description="MiB of K/V of finished generations kept for prompts "
                                   "that start with them (lean forward only; 0: off); cleared on weight updates")
    grammar_backend: Literal["xgrammar", "none"] = Field(
        "xgrammar", description="SGLang's --grammar-backend: xgrammar compiles sampling_params' json_schema, regex, "
        "ebnf and structural_tag (rollout/grammar.py); none refuses them")
    constrained_json_disable_any_whitespace: bool = Field(False, description="SGLang's flag: JSON under a schema "
                                                          "is compact (no free whitespace between tokens)")
    constrained_json_max_whitespace_cnt: int | None = Field(None, ge=0, description="SGLang's flag: at most this "
                                                            "many whitespace characters in a row (None: any)")
    enable_return_routed_experts: bool = Field(False, description="SGLang's flag: an MoE model's /generate answers "
                                               "carry the experts each token was routed to when a request asks "
                                               "(return_routed_experts)")
    # LoRA serving (SGLang's flags and meanings; rollout/engine_lora.py)
    enable_lora: bool = Field(False, description="serve LoRA adapters beside the base (lean forward only)")
    max_lora_rank: int | None = Field(None, ge=1, description="the largest adapter rank served (default: the largest "
                                      "of lora_paths, else 64)")
    lora_target_modules: list[str] | None = Field(None, description="projections adapters may target (PEFT names or "
                                                  "'all'); default: all of them")
    lora_paths: list[str] = Field(default_factory=list, description="adapters loaded at start: name=path or path")
    max_loras_per_batch: int = Field(8, ge=1, description="distinct adapters (the base counts as one) in one batch")
    max_loaded_loras: int | None = Field(None, ge=1, description="adapters loaded at once (default: "
                                         "max_loras_per_batch)")
