"""Per-token log-probs and entropy from tensor-parallel (vocab-sharded) logits, without a full gather.

Why: with TP each rank holds logits for a slice of the vocabulary. Gathering [tokens, vocab]
logits to every rank costs TP x memory and bandwidth; like Megatron's vocab-parallel cross
entropy, only per-token scalars are all-reduced here (the max, the sum of exps, the target
logit, the entropy term). The reductions use Megatron's ``reduce_from_tensor_model_parallel_region``
(forward all-reduce, backward identity), which is the correct gradient only because every TP
rank computes the same function of the reduced values (each reduced input is purely local). With TP=1 the reductions are no-ops.

Vocabulary padding rows (added so the vocab divides by TP) are masked to -inf so they never
take probability mass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_info() -> tuple[int, int, dist.ProcessGroup | None]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    size = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if size > 1 else None
    return ps.get_tensor_model_parallel_rank(), size, group


def _reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return t
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t, group)


def shard_start(v_local: int) -> int:
    """The first global token id of this TP rank's vocab shard of ``v_local`` columns."""
    return _tp_info()[0] * v_local


def vocab_parallel_logprobs(
    local_logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) under softmax(logits / temperature), and optionally the entropy, per token.

    ``local_logits`` [..., V_local] is this TP rank's contiguous vocab shard (rank r holds global
    ids ``[r*V_local, (r+1)*V_local)``); ``targets`` [...] are global token ids; ``vocab_size`` is
    the real (unpadded) vocabulary. Returns tensors shaped like ``targets`` (fp32), differentiable.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    tp_rank, _, group = _tp_info()
    v_local = local_logits.shape[-1]
    start = tp_rank * v_local
    logits = local_logits.float() / temperature
    if start + v_local > vocab_size:
        col = torch.arange(start, start + v_local, device=logits.device)
        logits = logits.masked_fill(col >= vocab_size, float("-inf"))

    # Numerically stable log-sum-exp across shards; the max is a constant shift (no gradient).
    local_max = logits.detach().amax(dim=-1)
    if group is not None:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp_shifted = shifted.exp()
    sum_exp = _reduce_sum(exp_shifted.sum(dim=-1), group)
    log_z = sum_exp.log()

    in_shard = (targets >= start) & (targets < start + v_local)
    local_idx = (targets - start).clamp(0, v_local - 1)
    picked = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
    target_shifted = _reduce_sum(torch.where(in_shard, picked, torch.zeros_like(picked)), group)
    logprobs = target_shifted - log_z

    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v * shifted_v = log Z - (sum_v e^shifted_v * shifted_v) / Z. Written so
        # that only purely local sums are reduced and everything after the reductions is the same
        # on every rank: that is what makes the identity backward of the reduction exact (reducing
        # per-rank p*log(p) terms that each depend on the shared log Z would drop cross-rank terms).
        # Padding columns: e^-inf = 0 and shifted is zeroed first, so 0 * -inf never forms a NaN.
        weighted = _reduce_sum((exp_shifted * shifted.masked_fill(torch.isinf(shifted), 0.0)).sum(dim=-1), group)
        entropy = log_z - weighted / sum_exp
    return logprobs, entropy
