"""One RL / SFT optimizer step of a Megatron-core policy over a global batch of ``TrainSample``.

Flow (every TP/DP rank runs it with the SAME global batch):
  1. this DP rank takes its share of the samples (balanced by tokens);
  2. ``pack_samples`` cuts the share into micro-batches of at most ``max_tokens_per_micro_batch``
     tokens, each one packed row with position ids restarting per sample (with ``share_prefixes``
     the forward runs over the row's token tree: each prefix that samples share, once);
  3. per micro-batch: Megatron forward -> per-token log-probs of the sampled tokens
     (``logits / temperature``, vocab-parallel log-softmax, no logits gather) -> ``policy_loss``
     -> backward. Loss normalisers are taken over the GLOBAL batch (all DP ranks), so the sum
     of micro-batch losses is the global loss and packed == unpacked exactly;
  4. ``optimizer_step``: Megatron's ``finalize_model_grads`` (DP all-reduce, TP all-reduce of
     the Qwen3 q/k-norm grads), then clip, Adam, LR schedule.

Log-prob alignment follows ``TrainSample``: position i holds log p(tokens[i] | tokens[:i]);
position 0 of every sample is 0. With PP > 1 the micro-batches run through Megatron's pipeline schedule
(``trainer/pipeline.py``); the last stage scores them and every stage returns its metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field
from torch import nn

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.trainer import routing_replay
from slime_server.trainer.adapter_isolation import only_adapters
from slime_server.trainer.grammar_masks import allowed_columns
from slime_server.trainer.losses import policy_loss
from slime_server.trainer.model import forward_micro_batch, unwrap
from slime_server.trainer.optimizer import OptimizerBundle, optimizer_step, zero_grads
from slime_server.trainer.packing import MicroBatch, pack_samples, split_packed
from slime_server.trainer.pipeline import from_last_stage, is_last_stage, pipeline_size, run_schedule
from slime_server.trainer.settings import LossConfig
from slime_server.trainer.types import TrainSample
from slime_server.trainer.vocab_parallel import shard_start, vocab_parallel_logprobs


class TrainStepSettings(BaseModel):
    """How a global batch is cut and scored (loss details live in ``LossConfig``)."""

    max_tokens_per_micro_batch: int = Field(8192, gt=0, description="rows of a micro-batch's forward")
    share_prefixes: bool = Field(True, description="samples' common prefixes computed once (trainer/prefix_tree.py)")
    temperature: float = Field(1.0, gt=0, description="the rollout sampling temperature")
    loss: LossConfig = Field(default_factory=LossConfig)


def _dp() -> tuple[int, int, dist.ProcessGroup | None]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


def dp_shard(samples: Sequence[TrainSample], dp_rank: int, dp_size: int) -> list[int]:
    """Indices of the samples DP rank ``dp_rank`` trains on: longest-first greedy token balance."""
    loads = [0] * dp_size
    owner: dict[int, int] = {}
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i].tokens), i)):
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += len(samples[i].tokens)
    return [i for i in range(len(samples)) if owner[i] == dp_rank]


def micro_batch_logits(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The local logits shard [T, vocab / tp] of a micro-batch's tokens in the samples' layout (the forward
    runs over its token tree when it has one: each shared prefix once)."""
    return mb.expand(forward_micro_batch(model, mb)[0])


def packed_logprobs(
    model: nn.Module, mb: MicroBatch, *, temperature: float = 1.0, with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of a micro-batch's packed row [T] (positions reset per sample).

    Entry i scores tokens[i] with the logits at i-1; entries where a sample starts
    (``position_ids == 0``) are 0 because nothing in the row predicts them.
    """
    return logits_logprobs(model, micro_batch_logits(model, mb), mb.tokens, mb.position_ids,
                           temperature=temperature, with_entropy=with_entropy, grammar=grammar_of(mb))


def grammar_of(mb: MicroBatch) -> tuple[torch.Tensor, bytes] | None:
    """The micro-batch's grammar rows and bitmasks (tokens sampled under a grammar), or None."""
    return None if mb.grammar_rows is None else (mb.grammar_rows, mb.grammar_bitmask or b"")


def masked_to_grammar(local_logits: torch.Tensor, rows: torch.Tensor, bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """``local_logits`` [T, V_local] with the logits predicting each grammar position's token (row - 1) set to -inf
    where the grammar forbade a token: the distribution the engine sampled from (trainer/grammar_masks.py)."""
    width = local_logits.shape[-1]
    allowed = allowed_columns(bitmask, int(rows.numel()), shard_start(width), width, vocab_size)
    at = (rows - 1).to(local_logits.device)
    out = local_logits.clone()
    out[at] = local_logits[at].masked_fill(~allowed.to(local_logits.device), float("-inf"))
    return out


def logits_logprobs(
    model: nn.Module, local_logits: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor, *,
    temperature: float = 1.0, with_entropy: bool = False, grammar: tuple[torch.Tensor, bytes] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``packed_logprobs`` from a packed row's local logits shard [T, vocab / tp] (the last pipeline stage's);
    ``grammar``: rows sampled under a grammar and their bitmasks, scored under the same mask."""
    tokens, position_ids = tokens.to(local_logits.device), position_ids.to(local_logits.device)
    if grammar is not None:
        local_logits = masked_to_grammar(local_logits, grammar[0], grammar[1], unwrap(model).arch.vocab_size)
    lp_next, ent_next = vocab_parallel_logprobs(
        local_logits[:-1], tokens[1:], vocab_size=unwrap(model).arch.vocab_size,
        temperature=temperature, with_entropy=with_entropy,
    )
    starts = position_ids == 0

    def align(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.new_zeros(1), x]).masked_fill(starts, 0.0)

    return align(lp_next), (align(ent_next) if ent_next is not None else None)


@torch.no_grad()
def compute_logprobs(
    model: nn.Module, samples: Sequence[TrainSample], *, temperature: float = 1.0,
    max_tokens_per_micro_batch: int = 8192, share_prefixes: bool = True,
) -> list[torch.Tensor]:
    """Log-probs [len(tokens)] per sample under ``model`` (old / reference policy), no grad.

    Every TP rank of the group must call it (the vocab reductions are collectives); each rank
    scores ALL samples (no DP split), so the result is complete on every rank.
    """
    was_training = model.training
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(samples)
    micro_batches = pack_samples(list(samples), max_tokens_per_micro_batch, share_prefixes=share_prefixes)

    def keep(mb: MicroBatch, lp: torch.Tensor) -> None:
        for idx, piece in zip(mb.sample_indices, split_packed(lp.cpu(), mb.sample_lens), strict=True):
            out[idx] = piece

    try:
        if pipeline_size() > 1:
            def score(mb: MicroBatch, local_logits: torch.Tensor) -> torch.Tensor:
                lp, _ = logits_logprobs(model, local_logits, mb.tokens, mb.position_ids, temperature=temperature,
                                        grammar=grammar_of(mb))
                keep(mb, lp)
                return lp.sum() * 0.0

            run_schedule(model, micro_batches, score, forward_only=True)
            out = from_last_stage(out)
        else:
            for mb in micro_batches:
                keep(mb, packed_logprobs(model, mb, temperature=temperature)[0])
    finally:
        model.train(was_training)
    return [t if t is not None else torch.zeros(0) for t in out]


@torch.no_grad()
def compute_logprobs_and_routes(
    model: nn.Module, samples: Sequence[TrainSample], *, temperature: float = 1.0,
    max_tokens_per_micro_batch: int = 8192,
) -> tuple[list[torch.Tensor], list[RoutedExperts]]:
    """``compute_logprobs`` of an MoE policy, with the experts its routers chose for each sample's positions in that
    forward (all but the last token, as the engine records them): R2, the old policy's routing, replayed in the
    training forwards of the batch's mini-batches so that their updates do not move the routing the ratio compares.

    Samples are packed without a token tree: each sample's own rows route its tokens. One pipeline stage only
    (each stage would hold its own layers' routes)."""
    if pipeline_size() > 1:
        raise NotImplementedError("moe.routing_replay 'trainer' records routes on one pipeline stage; this trainer "
                                  f"has {pipeline_size()}")
    if not unwrap(model).arch.is_moe:
        raise ValueError("moe.routing_replay 'trainer' needs a mixture-of-experts model; this one is dense")
    was_training = model.training
    model.eval()
    logprobs: list[torch.Tensor] = [torch.zeros(0)] * len(samples)
    routes: list[RoutedExperts | None] = [None] * len(samples)
    try:
        for mb in pack_samples(list(samples), max_tokens_per_micro_batch, share_prefixes=False):
            with routing_replay.recording(model) as found:
                lp = packed_logprobs(model, mb, temperature=temperature)[0]
            ids = torch.stack(found, dim=1).cpu()  # [T, layers, k] of the packed row
            pieces = zip(mb.sample_indices, split_packed(lp.cpu(), mb.sample_lens), ids.split(mb.sample_lens),
                         strict=True)
            for idx, piece, chosen in pieces:
                logprobs[idx], routes[idx] = piece, RoutedExperts.of(chosen[:-1].numpy())
    finally:
        model.train(was_training)
    assert all(r is not None for r in routes)
    return logprobs, [r for r in routes if r is not None]


def _gather_rows(
    values: Sequence[torch.Tensor] | None, mb: MicroBatch, device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """Concatenate per-sample tensors (e.g. old / reference log-probs) in the micro-batch's order."""
    if values is None:
        return None
    rows = [torch.as_tensor(values[i], dtype=torch.float32) for i in mb.sample_indices]
    for i, row, n in zip(mb.sample_indices, rows, mb.sample_lens, strict=True):
        if row.shape != (n,):
            raise ValueError(f"per-token log-probs of sample {i} have shape {tuple(row.shape)}, expected ({n},)")
    return torch.cat(rows).to(device)


class _MetricSums:
    """Token-weighted sums of micro-batch metrics; max/min keys keep extremes."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weight = 0.0

    def add(self, metrics: dict[str, float | torch.Tensor], weight: float) -> None:
        self.weight += weight
        for key, value in metrics.items():
            v = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
            if key.endswith("_max"):
                self.sums[key] = max(self.sums.get(key, v), v)
            elif key.endswith("_min"):
                self.sums[key] = min(self.sums.get(key, v), v)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + v * weight

    def reduce(self, group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
        """Batch averages over the DP ranks (``device``: where the group's backend reduces, the GPU for NCCL)."""
        keys = sorted(self.sums)
        if group is not None and dist.get_world_size(group) > 1:
            # Every DP rank must contribute the same keys: losses emit a fixed metric set.
            vals = torch.tensor([self.sums[k] for k in keys] + [self.weight], dtype=torch.float64, device=device)
            maxes = vals.clone()
            mins = vals.clone()
            dist.all_reduce(vals, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
            total = float(vals[-1])
            merged = {}
            for j, k in enumerate(keys):
                merged[k] = float(maxes[j]) if k.endswith("_max") else float(mins[j]) if k.endswith("_min") \
                    else float(vals[j])
            sums, weight = merged, total
        else:
            sums, weight = self.sums, self.weight
        return {k: (v if k.endswith(("_max", "_min")) else v / max(weight, 1e-12)) for k, v in sums.items()}


def forward_backward(
    bundle: OptimizerBundle, samples: Sequence[TrainSample], settings: TrainStepSettings, *,
    old_logprobs: Sequence[torch.Tensor] | None = None, ref_logprobs: Sequence[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of the GLOBAL-batch loss into the DDP grad buffer (no optimizer step).

    Returns the loss, loss metrics averaged over the batch's masked tokens, and batch counts.
    ``old_logprobs`` default to the current policy's own log-probs (detached): exact for the
    usual one-optimizer-step-per-rollout-batch schedule, and it saves a forward pass.
    ``ref_logprobs`` are needed when the loss has a KL term.
    """
    if not samples:
        raise ValueError("a training step needs at least one sample")
    cfg = settings.loss
    dp_rank, dp_size, dp_group = _dp()
    model = bundle.model
    model.train()
    if len(samples) < dp_size:
        raise ValueError(f"global batch of {len(samples)} samples cannot feed {dp_size} data-parallel ranks")
    mine = dp_shard(samples, dp_rank, dp_size)
    micro_batches = pack_samples(list(samples), settings.max_tokens_per_micro_batch, subset=mine,
                                 share_prefixes=settings.share_prefixes)
    device = next(model.parameters()).device
    sums = _MetricSums()
    loss_total = torch.zeros((), dtype=torch.float64, device=device)  # NCCL reduces device tensors only

    def micro_batch_loss(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        nonlocal loss_total
        if cfg.entropy_coef == 0.0 and entropy is not None:
            entropy = entropy.detach()
        old = _gather_rows(old_logprobs, mb, device)
        loss, metrics = policy_loss(
            cfg, logprobs=logprobs, old_logprobs=logprobs.detach() if old is None else old,
            rollout_logprobs=mb.rollout_logprobs.to(device), advantages=mb.advantages.to(device),
            loss_mask=mb.loss_mask.to(device), sample_lens=mb.sample_lens,
            ref_logprobs=_gather_rows(ref_logprobs, mb, device), entropy=entropy,
            token_weights={k: w.to(device) for k, w in mb.token_weights.items()},
        )
        loss_total += loss.detach().double()
        sums.add(metrics, weight=float(mb.loss_mask.sum()))
        # DDP averages grads over DP ranks; the global normaliser already divides by the whole
        # batch, so undo the average to keep the summed (= global) gradient.
        return loss * dp_size

    if pipeline_size() > 1:
        def on_output(mb: MicroBatch, local_logits: torch.Tensor) -> torch.Tensor:
            logprobs, entropy = logits_logprobs(model, local_logits, mb.tokens, mb.position_ids,
                                                temperature=settings.temperature, with_entropy=True,
                                                grammar=grammar_of(mb))
            return micro_batch_loss(mb, logprobs, entropy)

        run_schedule(model, micro_batches, on_output, forward_only=False)  # backward included
    else:
        for mb in micro_batches:
            # Entropy is always computed: it is a cheap by-product of the log-sum-exp and a key metric;
            # it joins the graph only when the loss has an entropy bonus.
            logprobs, entropy = packed_logprobs(model, mb, temperature=settings.temperature, with_entropy=True)
            micro_batch_loss(mb, logprobs, entropy).backward()
    out: dict[str, float] = {}
    if is_last_stage():  # the stages before it hold no loss: they get the last stage's metrics below
        if dp_group is not None and dp_size > 1:
            dist.all_reduce(loss_total, group=dp_group)
        out = sums.reduce(dp_group if dp_size > 1 else None, device)
        out.update(
            loss=float(loss_total), micro_batches=float(len(micro_batches)),
            tokens=float(sum(len(s.tokens) for s in samples)),
            loss_tokens=float(sum(sum(s.loss_mask) for s in samples)),
        )
    return from_last_stage(out)


def train_step(
    bundle: OptimizerBundle, samples: Sequence[TrainSample], settings: TrainStepSettings, *,
    old_logprobs: Sequence[torch.Tensor] | None = None, ref_logprobs: Sequence[torch.Tensor] | None = None,
) -> dict[str, float]:
    """One optimizer step on the global batch: ``forward_backward`` then clip + Adam + LR schedule.

    Metrics add ``grad_norm`` (before clipping), ``lr`` (used by this step) and ``step_skipped``.
    """
    zero_grads(bundle)
    routing_replay.take_totals()  # what the log-prob passes replayed is not this step's metric
    metrics = forward_backward(bundle, samples, settings, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    with only_adapters(bundle, {s.adapter for s in samples}):  # a multi-adapter trainer: the others stay put
        result = optimizer_step(bundle)
    metrics.update(grad_norm=result.grad_norm, lr=result.lr, step_skipped=float(not result.updated))
    replayed = routing_replay.take_totals()
    if replayed.total:  # routing replay: how often the router's own top-k was the engine's, and who had no routes
        metrics.update(moe_replay_topk_agreement=replayed.rate,
                       moe_samples_without_routes=float(sum(s.routed_experts is None for s in samples)))
    return metrics
