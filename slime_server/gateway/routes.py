"""An MoE model's routed experts through the gateway: asked of the engines with every recorded turn, checked against
the turn's tokens, kept with its trajectory (buffer/routed_experts.py) for routing replay.

Why from ``routes_start``: a session's next turn extends the trajectory, whose routes cover all but its last token;
the engine is asked only for the positions after them (SGLang's ``routed_experts_start_len``), so a long session's
turn costs its new tokens' routes, not the whole history's again. The prefix keeps the routes recorded when its
tokens were run; where an engine ran it again (a prefix-cache miss after a weight update), the prefix's routes stay
those its recorded log-probs came from.
"""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.gateway.engine_client import EngineError
from slime_server.rollout.protocol import GenerateOutput


def request_fields(gw: Any, prepared: Any) -> dict[str, Any]:
    """The ``/generate`` fields asking for routes (none unless ``gateway.record_routed_experts``)."""
    if not gw.settings.record_routed_experts:
        return {}
    return {"return_routed_experts": True, "routed_experts_start_len": int(prepared.routes_start)}


@cache
def moe_shape(model_dir: str) -> tuple[int, int] | None:
    """(layers, top-k) of the served model's config (None: not a mixture of experts)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    topk = config.get("num_experts_per_tok")
    return (int(config["num_hidden_layers"]), int(topk)) if topk and "num_hidden_layers" in config else None


def answer_routes(gw: Any, out: GenerateOutput, prompt_len: int, start: int) -> RoutedExperts | None:
    """A finished choice's routes from position ``start`` (None unless asked, or for an abort that ran nothing);
    an answer without them, or of another shape than its tokens, is the engine's fault: a 502 naming why."""
    if not gw.settings.record_routed_experts:
        return None
    shape = moe_shape(str(gw.renderer.tokenizer.name_or_path))
    if shape is None:
        raise EngineError(502, "gateway.record_routed_experts is on but the served model is not a mixture of "
                          "experts (its config has no num_experts_per_tok)", code="routes_unavailable")
    raw = out.meta_info.routed_experts
    reason = out.meta_info.finish_reason
    if raw is None:
        if reason is not None and reason.type == "abort":
            return None
        raise EngineError(502, "the engine answered without routed_experts: start the engines with "
                          "--enable-return-routed-experts (engine.enable_return_routed_experts)",
                          code="routes_unavailable")
    ids = np.frombuffer(base64.b64decode(raw), dtype="<i4")
    layers, topk = shape
    rows = prompt_len + len(out.output_ids) - 1 - start
    if rows < 0 or ids.size != rows * layers * topk:
        raise EngineError(502, f"the engine's routed_experts hold {ids.size} ids; positions [{start}, "
                          f"{prompt_len + len(out.output_ids) - 1}) x {layers} layers x top-{topk} need "
                          f"{max(rows, 0) * layers * topk}", code="bad_engine_response")
    return RoutedExperts.of(ids.reshape(rows, layers, topk))
