"""An MoE model's routed experts in the CPU engine, kept and answered as SGLang 0.5.23 does.

Why: routing replay (R3) trains on the experts the engine chose for every token. SGLang keeps each token's
top-k ids beside its K/V slot (``RoutedExpertsCapturer``: a prefix-cache hit keeps the routes computed with that
prefix; a re-prefill writes new ones) and, for a request that asked (``return_routed_experts``) on a server
started with ``--enable-return-routed-experts``, answers them once the request finishes: ``meta_info
["routed_experts"]``, base64 of the int32 array [seqlen - 1 - start_len, num_hidden_layers, top-k] (numpy's
``tobytes``: little-endian here), seqlen = prompt + output tokens; positions from ``routed_experts_start_len``
(0 = all). A sequence here keeps its positions' routes in pieces (``Sequence.routes``); the prefix cache keeps them
with the K/V.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from slime_server.rollout.engine_sequence import Sequence


def check_servable(enabled: bool, lean: Any) -> None:
    """``--enable-return-routed-experts`` needs what records routes: an MoE model on the lean forward."""
    if enabled and (lean is None or not lean.num_experts):
        raise ValueError("--enable-return-routed-experts needs a mixture-of-experts model (qwen3_moe) served by the "
                         "lean forward (--forward lean)")


def start_len_error(seq_prompt_len: int, start_len: int) -> str | None:
    """SGLang's refusal of a ``routed_experts_start_len`` outside [0, prompt tokens] (its scheduler aborts such a
    request with these words)."""
    if start_len < 0:
        return (f"recv_req.routed_experts_start_len={start_len} is lower than 0. Please use a non-negative "
                "routed_experts_start_len.")
    if start_len > seq_prompt_len:
        return (f"recv_req.routed_experts_start_len={start_len} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={seq_prompt_len}. Please use a smaller routed_experts_start_len.")
    return None


def after_prefill(seq: Sequence, reused: torch.Tensor | None, start: int, computed: torch.Tensor | None) -> None:
    """A prefill's routes: the reused prefix's (from the prefix cache) and the computed positions'."""
    if computed is None:
        return
    seq.routes = ([reused[:start]] if start and reused is not None else []) + [computed]


def after_decode(batch: list[Sequence], lean: Any) -> None:
    """A decode step's routes (the lean forward's ``last_routes``; HF's forward keeps none): row b is sequence b's
    new position."""
    computed = None if lean is None else lean.last_routes
    if computed is None:
        return
    for b, seq in enumerate(batch):
        seq.routes.append(computed[b:b + 1])


def held(seq: Sequence) -> torch.Tensor | None:
    """The routes of the positions the sequence has run (``kv_len`` rows), or None for a dense model."""
    return torch.cat(seq.routes)[: seq.kv_len] if seq.routes else None


def answer(seq: Sequence) -> str | None:
    """``meta_info["routed_experts"]`` of a finished sequence that asked for it, else None."""
    if not seq.return_routed_experts or not seq.routes:
        return None
    seqlen = len(seq.prompt_ids) + len(seq.output_ids)
    routes = torch.cat(seq.routes)[: max(0, seqlen - 1)]
    start = min(seq.routed_experts_start_len, max(0, seqlen - 1))
    return base64.b64encode(routes[start:].contiguous().numpy().astype("<i4").tobytes()).decode()


def decode(b64: str, num_layers: int, topk: int) -> torch.Tensor:
    """The int32 [positions, layers, top-k] array an answer's ``routed_experts`` holds (SGLang's or ours)."""
    raw = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    if raw.size % (num_layers * topk):
        raise ValueError(f"routed_experts of {raw.size} ids is not a whole number of [{num_layers}, {topk}] rows")
    return torch.from_numpy(raw.copy()).view(-1, num_layers, topk)
