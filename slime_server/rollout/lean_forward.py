"""A lean forward pass for the CPU engine over a Llama-family model's tensors (HF names and layout).

Why: on a CPU, HF's ``model()`` spends most of a decode step outside the matmuls (module calls,
cache objects, masks built per step), and a batch of ragged sequences needed its caches copied into
one padded ``DynamicCache`` every step. This forward does per layer only what the math needs: one
fused QKV matmul, one fused gate/up matmul, RoPE, and attention of each sequence over its own
preallocated K/V buffer (``engine_sequence.Sequence.kv``: nothing is copied between steps).

The fused weights are the model's storage: the named tensors (``q_proj.weight`` ...) become views
into them, so a weight update copied into them (``CPUEngine.load_weights``) updates the fused
matmuls too. The tensors come straight from the checkpoint (engine_model.py); architectures: llama,
mistral (no sliding window), qwen2, qwen3; anything else keeps the HF path
(``engine_model.lean_supported``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own convention

from slime_server.rollout.engine_model import Rope, lean_supported
from slime_server.rollout.engine_sequence import Sequence

# fp32 vocabulary projections at least this large go through oneDNN, on a copy of the weight: MKL's fp32
# GEMV read them at ~11 GB/s on the 2-core AMD EPYC the benchmarks ran on, oneDNN at ~20 (SmolLM2's 576 x
# 49152: 10.2 -> 5.4 ms per token at batch 1, 17.6 -> 8.4 ms at 8)
MKLDNN_HEAD_MIN = 8 * 2**20
PREFILL_MASK_ELEMENTS = 16 * 2**20  # attention mask elements per chunk of a prefill after a reused prefix


@dataclass
class _Layer:
    qkv: torch.Tensor  # [(nh + 2 * nkv) * hd, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 * I, H]
    down: torch.Tensor
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _fuse(params: MutableMapping[str, torch.Tensor], names: Seq[str]) -> torch.Tensor:
    """One tensor holding ``names``' tensors stacked on dim 0; each name then maps to a view into it."""
    fused = torch.cat([params[n] for n in names], dim=0)
    start = 0
    for n in names:
        rows = params[n].shape[0]
        params[n] = fused[start:start + rows]
        start += rows
    return fused


class LeanForward:
    """``prefill`` (one sequence, its prompt) and ``decode`` (a batch, one token each) -> logits."""

    def __init__(self, cfg: Any, params: MutableMapping[str, torch.Tensor], rope: Rope) -> None:
        """``params``: the model's tensors by HF state-dict name (engine_model.load_engine_model); the names
        fused here are replaced by views into the fused tensors, so copying an update into ``params[name]``
        updates what this forward computes with."""
        if not lean_supported(cfg):
            raise ValueError(f"no lean forward for {cfg.model_type!r}")
        self.embed = params["model.embed_tokens.weight"]
        self.final_norm = params["model.norm.weight"]
        self.lm_head = params["lm_head.weight"]
        self.rope = rope
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.layers: list[_Layer] = []
        for i in range(int(cfg.num_hidden_layers)):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = [f"{a}{x}_proj" for x in "qkv"]
            bias = _fuse(params, [f"{p}.bias" for p in qkv]) if f"{a}q_proj.bias" in params else None
            self.layers.append(_Layer(
                qkv=_fuse(params, [f"{p}.weight" for p in qkv]), qkv_bias=bias, o=params[f"{a}o_proj.weight"],
                o_bias=params.get(f"{a}o_proj.bias"),
                gate_up=_fuse(params, [f"{m}gate_proj.weight", f"{m}up_proj.weight"]),
                down=params[f"{m}down_proj.weight"],
                in_norm=params[f"model.layers.{i}.input_layernorm.weight"],
                post_norm=params[f"model.layers.{i}.post_attention_layernorm.weight"],
                q_norm=params.get(f"{a}q_norm.weight"), k_norm=params.get(f"{a}k_norm.weight")))
        self._pool: list[tuple[torch.Tensor, torch.Tensor]] = []  # the decode batch's K/V (see decode)
        self._cap = 0
        self._head: torch.nn.Module | None = None
        self._head_stale = True  # the oneDNN copy of lm_head is (re)built by the next forward that needs it
        self.group = self.n_heads // self.n_kv
        self.scale = self.head_dim ** -0.5
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim

    # ------------------------------------------------------------------ pieces
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in one op (torch computes its statistics in fp32 for bf16 input too, as HF does)."""
        return F.rms_norm(x, weight.shape, weight, self.eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, H] -> q [N, nh, hd], k and v [N, nkv, hd], normed (qwen3) and rotated."""
        n = h.shape[0]
        heads = F.linear(h, layer.qkv, layer.qkv_bias).view(n, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = heads[:, : self.n_heads + self.n_kv], heads[:, self.n_heads + self.n_kv:]
        if layer.q_norm is not None:
            qk = torch.cat((self._norm(qk[:, : self.n_heads], layer.q_norm),
                            self._norm(qk[:, self.n_heads:], layer.k_norm)), dim=1)
        qk = self._rope(qk, cos[:, None, :], sin[:, None, :])  # q and k heads rotated in one go
        return qk[:, : self.n_heads], qk[:, self.n_heads:], v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self._norm(x, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    def _positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(positions, self.embed.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self._norm(x, self.final_norm)
        if self._head_stale:
            self._rebuild_head()
        if self._head is not None:
            return self._head(h)
        return F.linear(h, self.lm_head)

    def weights_changed(self, tensors: Seq[torch.Tensor]) -> None:
        """``tensors`` (the engine's, by name) were overwritten: what copies them must be rebuilt. Only the
        oneDNN vocabulary projection copies a weight, and it is rebuilt once, by the next forward: a push of N
        buckets (engine paused) used to rebuild it after every bucket, a copy of the embedding each time (16
        rebuilds of 131 MB in a 257 MB push of 16 MiB buckets)."""
        head = self.lm_head.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == head for t in tensors):
            self._head_stale = True

    def _rebuild_head(self) -> None:
        self._head_stale = False
        self._head = None
        if (self.lm_head.dtype == torch.float32 and self.lm_head.numel() >= MKLDNN_HEAD_MIN
                and torch.backends.mkldnn.is_available()):
            from torch.utils.mkldnn import MkldnnLinear

            dense = torch.nn.Linear(self.lm_head.shape[1], self.lm_head.shape[0], bias=False)
            dense.weight = torch.nn.Parameter(self.lm_head.detach(), requires_grad=False)
            self._head = MkldnnLinear(dense, torch.float)

    # ------------------------------------------------------------------ passes
    def prefill(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], all_logits: bool = False,
                start: int = 0) -> torch.Tensor:
        """Run one sequence's ``ids[start:]``, writing their K/V into ``kv`` (per layer [nkv, cap, hd], cap >=
        len(ids)), whose first ``start`` positions already hold ``ids[:start]``'s (a reused prefix); returns
        the logits of every computed position, or of the last only."""
        n, new = len(ids), len(ids) - start
        x = F.embedding(torch.tensor(ids[start:]), self.embed)
        cos, sin = self._positions(torch.arange(start, n))
        for layer, (kb, vb) in zip(self.layers, kv, strict=True):
            q, k, v = self._qkv(layer, self._norm(x, layer.in_norm), cos, sin)
            kb[:, start:n] = k.transpose(0, 1)
            vb[:, start:n] = v.transpose(0, 1)
            att = self._prefill_attention(q.transpose(0, 1)[None], kb[None], vb[None], start, n)  # [1, nh, new, hd]
            x = x + F.linear(att[0].transpose(0, 1).reshape(new, self.q_size), layer.o, layer.o_bias)
            x = self._mlp(layer, x)
        return self._logits(x if all_logits else x[-1:])

    @staticmethod
    def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """Causal attention of the new positions ``start..n-1`` over positions ``0..n-1``, all 4-D so torch
        takes its flash kernel (a 3-D call falls back to the math kernel, which holds an [n, n] matrix: 10 GB
        for a 25k-token agent prompt). With a reused prefix the queries do not start at 0, so the mask is
        explicit, built per chunk of queries to stay within ``PREFILL_MASK_ELEMENTS``."""
        if start == 0:
            return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], is_causal=True, enable_gqa=True)
        chunk = max(1, PREFILL_MASK_ELEMENTS // n)
        outs = []
        for i0 in range(0, n - start, chunk):
            i1 = min(n - start, i0 + chunk)
            keys = start + i1
            mask = torch.arange(keys)[None, :] <= torch.arange(start + i0, keys)[:, None]
            outs.append(F.scaled_dot_product_attention(q[:, :, i0:i1], k[:, :, :keys], v[:, :, :keys], attn_mask=mask,
                                                       enable_gqa=True))
        return torch.cat(outs, dim=2)

    def decode(self, batch: list[Sequence]) -> torch.Tensor:
        """One token for each sequence (its last output id at position ``kv_len``): logits [B, V]. Writes the
        token's K/V into the batch's buffer and advances every ``kv_len``.

        The running batch's K/V live in one padded buffer per layer, [B, nkv, cap, hd], row b being sequence
        b's (``seq.kv`` are views of its row). Attention is then three batched ops per layer whatever B is.
        The buffer is rebuilt (each sequence's K/V copied in once) only when the batch's members change or a
        sequence outgrows ``cap`` (which doubles): amortised over the steps in between, not paid per step."""
        n = len(batch)
        pos = torch.tensor([s.kv_len for s in batch])
        if not self._holds(batch) or int(pos.max()) >= self._cap:
            self._rebuild(batch, int(pos.max()) + 1)
        rows = torch.arange(n)
        length = int(pos.max()) + 1
        hidden = torch.arange(length)[None, :] > pos[:, None]  # [B, L]: positions a sequence does not have
        bias = torch.zeros((n, 1, 1, length), dtype=self.embed.dtype).masked_fill_(hidden[:, None, None, :],
                                                                                 float("-inf"))
        x = F.embedding(torch.tensor([s.output_ids[-1] for s in batch]), self.embed)
        cos, sin = self._positions(pos)
        for layer, (kp, vp) in zip(self.layers, self._pool, strict=True):
            q, k, v = self._qkv(layer, self._norm(x, layer.in_norm), cos, sin)
            kp[rows, :, pos] = k
            vp[rows, :, pos] = v
            q = q.view(n, self.n_kv, self.group, self.head_dim)  # query heads grouped by their K/V head
            scores = torch.matmul(q, kp[:, :, :length].transpose(-1, -2)).mul_(self.scale).add_(bias)  # [B,nkv,g,L]
            att = torch.matmul(torch.softmax(scores, dim=-1), vp[:, :, :length]).reshape(n, self.q_size)
            x = self._mlp(layer, x + F.linear(att, layer.o, layer.o_bias))
        for s in batch:
            s.kv_len += 1
        return self._logits(x)

    def _rebuild(self, batch: list[Sequence], need: int) -> None:
        """A new batch buffer holding every member's K/V so far, with room to grow (capacity doubles)."""
        cap = max(64, 1 << (need + 8).bit_length())
        if batch:
            cap = min(cap, max(need + 1, max(s.reserved_tokens for s in batch)))
        pool = [(self.embed.new_zeros((len(batch), self.n_kv, cap, self.head_dim)),
                 self.embed.new_zeros((len(batch), self.n_kv, cap, self.head_dim))) for _ in self.layers]
        for b, s in enumerate(batch):
            for (kp, vp), (kb, vb) in zip(pool, s.kv, strict=True):
                kp[b, :, : s.kv_len] = kb[:, : s.kv_len]
                vp[b, :, : s.kv_len] = vb[:, : s.kv_len]
            s.kv = [(kp[b], vp[b]) for kp, vp in pool]
        self._pool, self._cap = pool, cap

    def _holds(self, batch: list[Sequence]) -> bool:
        """Whether row b of the batch buffer is sequence b's K/V, for every b (and no other row exists)."""
        if not self._pool or self._pool[0][0].shape[0] != len(batch):
            return False
        rows = self._pool[0][0]
        return all(s.kv and s.kv[0][0].data_ptr() == rows[b].data_ptr() for b, s in enumerate(batch))

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.n_kv * self.head_dim * self.embed.element_size()

    def new_kv(self, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Empty per-layer K/V buffers for one sequence."""
        return [(self.embed.new_empty((self.n_kv, capacity, self.head_dim)),
                 self.embed.new_empty((self.n_kv, capacity, self.head_dim))) for _ in self.layers]
