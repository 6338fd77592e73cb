"""Routing replay for MoE models (R3): the trainer's routers forced to the experts the engine chose.

Why: the trainer's router and the engine's pick different experts for some tokens (other kernels, a few steps of
staleness), so the trainer computes log-probs of a different network than the one that sampled, and RL drifts or
collapses (arXiv 2510.11370). Replaying the engine's top-k ids makes the trainer's forward the sampling forward; the
router still learns, because the replayed experts' weights are its softmax at those ids (Megatron's
``RouterReplay`` semantics: ``scores.gather(1, ids)``).

Each MoE router of a model built by ``build_gpt_model`` carries a ``RouteReplay`` (installed by ``install``, in
place of Megatron's ``RouterReplay``, whose instances all sit in one process-wide list: every model a process ever
built, which the tests' many models would mix up). ``replaying(model, routes)`` forces routes for the forwards
inside it and counts how often the natural top-k agreed; ``recording(model)`` keeps what the routers chose.

Routes are int tensors [tokens, layers, topk] (the engine's ``routed_experts`` layout, one row per token of the
row the model runs, layers this pipeline stage holds, in its order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Agreement:
    """How many of the replayed (token, slot) choices the router would have made itself."""

    matched: int = 0
    total: int = 0

    @property
    def rate(self) -> float:
        return self.matched / self.total if self.total else 1.0


@dataclass
class ReplayStats:
    """Agreement of the natural top-k with the replayed ids, per MoE layer of this stage and in all."""

    layers: list[Agreement] = field(default_factory=list)

    @property
    def matched(self) -> int:
        return sum(a.matched for a in self.layers)

    @property
    def total(self) -> int:
        return sum(a.total for a in self.layers)

    @property
    def rate(self) -> float:
        return self.matched / self.total if self.total else 1.0


@dataclass
class RouteReplay:
    """One router's replay state; Megatron calls ``get_replay_topk`` from ``topk_routing_with_score_function``."""

    mode: str = "off"  # off | record | replay
    target: torch.Tensor | None = None  # [tokens, topk] while replaying
    recorded: torch.Tensor | None = None  # record mode: the router's choice; replay mode: the ids the forward used
    agreement: Agreement = field(default_factory=Agreement)

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopK | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        if self.mode == "off":
            return default_compute_topk(scores, topk, num_groups, group_topk)
        if self.mode == "record":
            probs, ids = default_compute_topk(scores, topk, num_groups, group_topk)
            self.recorded = ids.detach().clone()
            return probs, ids
        target = self.target
        if target is None or target.shape != (scores.shape[0], topk):
            got = None if target is None else tuple(target.shape)
            raise ValueError(f"routing replay: routes {got} for {scores.shape[0]} tokens x top-{topk}")
        ids = target.to(scores.device, torch.long)
        with torch.no_grad():
            natural = default_compute_topk(scores, topk, num_groups, group_topk)[1]
            known = (ids >= 0).all(dim=1, keepdim=True)  # a row of -1: nothing recorded, the router chooses
            ids = torch.where(known, ids, natural)
            agreed = (natural.unsqueeze(2) == ids.unsqueeze(1)).any(dim=1) & known
            self.agreement.matched += int(agreed.sum())
            self.agreement.total += int(known.sum()) * topk
            totals.matched += int(agreed.sum())
            totals.total += int(known.sum()) * topk
        self.recorded = ids
        return scores.gather(1, ids), ids


totals = Agreement()  # every replayed forward's agreement in this process, until reset (a step's metric)


def take_totals() -> Agreement:
    """The agreement summed since the last call (and reset)."""
    global totals
    out, totals = totals, Agreement()
    return out


def stage_routes(inner: nn.Module, routes: torch.Tensor) -> torch.Tensor:
    """The columns of recorded routes [tokens, all layers, k] for this pipeline stage's layers (``inner``: the
    unwrapped GPTModel)."""
    layers = inner.decoder.layers
    if routes.shape[1] != inner.arch.num_layers:
        raise ValueError(f"recorded routes cover {routes.shape[1]} layers; the model has {inner.arch.num_layers}")
    first = layers[0].layer_number - 1 if len(layers) else 0
    return routes[:, first:first + len(layers)]


def install(model: nn.Module) -> None:
    """Give every MoE router of ``model`` (an unwrapped GPTModel) its own ``RouteReplay``."""
    for router in routers(model):
        router.router_replay = RouteReplay()


def routers(model: nn.Module) -> list[Any]:
    """The MoE routers of this stage's layers, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _replays(model: nn.Module) -> list[RouteReplay]:
    found = [r.router_replay for r in routers(model)]  # modules() walks into DDP / Float16Module wrappers too
    if not all(isinstance(r, RouteReplay) for r in found):
        raise RuntimeError("this model's routers have no RouteReplay (build it with build_gpt_model)")
    return found


@contextmanager
def replaying(model: nn.Module, routes: torch.Tensor) -> Iterator[ReplayStats]:
    """Forwards inside route token t of layer l to ``routes[t, l]``; yields the agreement of the natural top-k
    with the replayed ids (filled on exit; for a metric)."""
    replays = _replays(model)
    if routes.dim() != 3 or routes.shape[1] != len(replays):
        raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)} for {len(replays)} MoE layers "
                         "(expected [tokens, layers, topk])")
    stats = ReplayStats([Agreement() for _ in replays])
    for layer, replay in enumerate(replays):
        replay.mode, replay.target, replay.agreement = "replay", routes[:, layer], stats.layers[layer]
    try:
        yield stats
    finally:
        for replay in replays:
            replay.mode, replay.target = "off", None


@contextmanager
def recording(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Forwards inside keep each router's top-k ids; the yielded list is filled on exit with the last forward's
    routes per layer ([tokens, topk] each; ``torch.stack(found, dim=1)`` is the [tokens, layers, topk] layout)."""
    replays = _replays(model)
    found: list[torch.Tensor] = []
    for replay in replays:
        replay.mode, replay.recorded = "record", None
    try:
        yield found
    finally:
        for replay in replays:
            if replay.recorded is not None:
                found.append(replay.recorded)
            replay.mode, replay.recorded = "off", None
