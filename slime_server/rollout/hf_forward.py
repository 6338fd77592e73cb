"""The CPU engine's reference forward: HF's ``model()`` with a ``DynamicCache`` (``EngineConfig.forward="hf"``).

Kept beside the lean forward (lean_forward.py) as the reference it is tested against, and for
architectures the lean forward does not cover. A decode step copies every sequence's K/V into one
left-padded cache and the new token's K/V back out: its cost grows with the batch's total context.
"""

from __future__ import annotations

import torch

from slime_server.rollout.engine_sequence import KV, Sequence, ensure_room


def hf_prefill(model: torch.nn.Module, ids: list[int], cap: int, want_input: bool) -> tuple[KV, torch.Tensor]:
    """K/V buffers of capacity ``cap`` holding ``ids``, and the logits of every position (or the last)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                logits_to_keep=0 if want_input else 1)
    kv: KV = []
    for layer in cache.layers:
        k, v = layer.keys[0], layer.values[0]  # [heads, n_prompt, head_dim]
        kb = k.new_empty((k.shape[0], cap, k.shape[2]))
        vb = v.new_empty((v.shape[0], cap, v.shape[2]))
        kb[:, :len(ids)] = k
        vb[:, :len(ids)] = v
        kv.append((kb, vb))
    return kv, out.logits[0]


def hf_decode(model: torch.nn.Module, batch: list[Sequence]) -> torch.Tensor:
    """One token per sequence: logits [B, V]; appends each token's K/V and advances ``kv_len``."""
    from transformers import DynamicCache

    n = len(batch)
    width = max(s.kv_len for s in batch)
    layers = []
    for li in range(len(batch[0].kv)):
        k0 = batch[0].kv[li][0]
        kk = k0.new_zeros((n, k0.shape[0], width, k0.shape[2]))
        vv = torch.zeros_like(kk)
        for b, s in enumerate(batch):
            kk[b, :, width - s.kv_len:] = s.kv[li][0][:, :s.kv_len]
            vv[b, :, width - s.kv_len:] = s.kv[li][1][:, :s.kv_len]
        layers.append((kk, vv))
    mask = torch.zeros((n, width + 1), dtype=torch.long)
    for b, s in enumerate(batch):
        mask[b, width - s.kv_len:] = 1
    ids = torch.tensor([[s.output_ids[-1]] for s in batch])
    pos = torch.tensor([[s.kv_len] for s in batch])
    cache = DynamicCache(ddp_cache_data=layers, config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    for s in batch:
        ensure_room(s)
    for li, layer in enumerate(cache.layers):
        newk, newv = layer.keys[:, :, -1], layer.values[:, :, -1]
        for b, s in enumerate(batch):
            s.kv[li][0][:, s.kv_len] = newk[b]
            s.kv[li][1][:, s.kv_len] = newv[b]
    for s in batch:
        s.kv_len += 1
    return out.logits[:, -1]
