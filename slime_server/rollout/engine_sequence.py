"""One generation's state in the CPU engine (a ``Sequence``) and its K/V buffers, which grow as it decodes.

Each request owns preallocated per-layer K/V buffers, sized at prefill for the prompt and a headroom of
output tokens, then doubled (capped at what the request reserved) when a long generation needs more."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_server.rollout.protocol import FinishReason, LogprobEntry, SamplingParams

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [kv heads, capacity, head dim]
KV_INITIAL_HEADROOM = 256  # output tokens' K/V space allocated at prefill; long generations grow it


@dataclass(eq=False)
class Sequence:
    """One generation (one prompt x one of its n samples) and all its scheduler state."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    logprob_text: bool = False
    on_update: Callable[[Sequence], None] | None = None
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[LogprobEntry]] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] | None = None
    input_top: list[list[LogprobEntry] | None] | None = None
    finish: FinishReason | None = None
    created: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    abort_requested: bool = False
    kv: KV = field(default_factory=list)
    kv_len: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (SGLang's cached_tokens)
    done: threading.Event = field(default_factory=threading.Event)
    grammar: Any = None  # an xgrammar GrammarMatcher when sampling_params names a grammar (rollout/grammar.py)
    lora: Any = None  # the LoRA adapter it is served with (engine_lora.LoadedAdapter; None: the base)
    return_routed_experts: bool = False  # SGLang's request fields (an MoE model's routes; engine_routes.py)
    routed_experts_start_len: int = 0
    routes: list[torch.Tensor] = field(default_factory=list)  # MoE: routes of positions 0 .. kv_len - 1, in pieces
    images: Any = None  # a vision-language prompt's images (engine_vision.PromptImages; prompt_ids are expanded)
    return_prompt_token_ids: bool = False  # SGLang's: the answer carries the (expanded) prompt ids

    @property
    def rope_delta(self) -> int:
        """mRoPE: a position past the prompt is its index plus this (0 without images)."""
        return self.images.delta if self.images is not None else 0

    def cache_key(self) -> list[int]:
        """The ids the prefix cache keys this sequence's K/V by: each image's pads replaced by its hash's ids."""
        ids = self.images.key_ids if self.images is not None else self.prompt_ids
        return ids + self.output_ids

    @property
    def lora_slot(self) -> int:
        return self.lora.slot if self.lora is not None else 0

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + (self.params.max_new_tokens or 0)


def ensure_room(seq: Sequence) -> None:
    """Grow a sequence's K/V buffers (doubling, capped at what it reserved) before writing one more token."""
    cap = seq.kv[0][0].shape[1]
    if seq.kv_len < cap:
        return
    new_cap = min(max(2 * cap, cap + 1), seq.reserved_tokens)
    grown = []
    for k, v in seq.kv:
        kb, vb = k.new_empty((k.shape[0], new_cap, k.shape[2])), v.new_empty((v.shape[0], new_cap, v.shape[2]))
        kb[:, :cap], vb[:, :cap] = k, v
        grown.append((kb, vb))
    seq.kv = grown
