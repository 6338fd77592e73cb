"""A lean forward pass for the CPU engine over a Llama-family model's tensors (HF names and layout).

Why: on a CPU, HF's ``model()`` spends most of a decode step outside the matmuls (module calls,
cache objects, masks built per step), and a batch of ragged sequences needed its caches copied into
one padded ``DynamicCache`` every step. This forward does per layer only what the math needs: one
fused QKV matmul, one fused gate/up matmul, RoPE, and attention of each sequence over its own
preallocated K/V buffer (``engine_sequence.Sequence.kv``: nothing is copied between steps).

The fused weights are the model's storage: the named tensors (``q_proj.weight`` ...) become views
into them, so a weight update copied into them (``CPUEngine.load_weights``) updates the fused
matmuls too, and every matmul reads them as stored: a decode step's few rows through gemv.c
(gemv.py), its larger batches through oneDNN in fp32, a prompt's through F.linear (see _use_onednn),
none on a packed copy. The tensors
come straight from the checkpoint (engine_model.py); architectures: llama, mistral (no sliding
window), qwen2, qwen3, qwen3_moe (all layers MoE); anything else keeps the HF path (``engine_model.lean_supported``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own convention

from slime_server.rollout import gemv
from slime_server.rollout.engine_lora import AdapterBank, RowSlots
from slime_server.rollout.engine_model import Rope, lean_supported, num_experts
from slime_server.rollout.engine_sequence import Sequence

Images = tuple[torch.Tensor, torch.Tensor] | None  # a prompt's image positions and their embeddings
PREFILL_MASK_ELEMENTS = 16 * 2**20  # attention mask elements per chunk of a prefill after a reused prefix


@dataclass
class _Layer:
    index: int
    qkv: torch.Tensor  # [(nh + 2 * nkv) * hd, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor | None  # [2 * I, H]; None in an MoE layer
    down: torch.Tensor | None
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    router: torch.Tensor | None = None  # MoE: [E, H]
    experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # MoE: each expert's ([2 * I, H] gate_up, down)


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

    def __init__(self, cfg: Any, params: MutableMapping[str, torch.Tensor], rope: Rope,
                 decode_kernel: Literal["c", "torch"] = "c") -> None:
        """``params``: the model's tensors by HF state-dict name (engine_model.load_engine_model); the names
        fused here are replaced by views into the fused tensors, so copying an update into ``params[name]``
        updates what this forward computes with."""
        if not lean_supported(cfg):
            raise ValueError(f"no lean forward for {cfg.model_type!r}")
        self.embed = params["model.embed_tokens.weight"]
        self.final_norm = params["model.norm.weight"]
        self.lm_head = params["lm_head.weight"]
        self.rope = rope
        self._mrope = rope.axis is not None  # a decode position is then the index plus the sequence's rope_delta
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.num_experts = num_experts(cfg)
        self.moe_topk = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.moe_norm_topk = bool(getattr(cfg, "norm_topk_prob", False))
        self.routes: list[torch.Tensor] | None = None  # MoE: each layer's top-k ids of the current call (see _moe)
        self.last_routes: torch.Tensor | None = None  # MoE: the last prefill's or decode step's, [N, layers, top-k]
        self.layers: list[_Layer] = []
        for i in range(int(cfg.num_hidden_layers)):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = [f"{a}{x}_proj" for x in "qkv"]
            bias = _fuse(params, [f"{p}.bias" for p in qkv]) if f"{a}q_proj.bias" in params else None
            dense = not self.num_experts
            self.layers.append(_Layer(
                index=i, qkv=_fuse(params, [f"{p}.weight" for p in qkv]), qkv_bias=bias, o=params[f"{a}o_proj.weight"],
                o_bias=params.get(f"{a}o_proj.bias"),
                gate_up=_fuse(params, [f"{m}gate_proj.weight", f"{m}up_proj.weight"]) if dense else None,
                down=params[f"{m}down_proj.weight"] if dense else None,
                in_norm=params[f"model.layers.{i}.input_layernorm.weight"],
                post_norm=params[f"model.layers.{i}.post_attention_layernorm.weight"],
                q_norm=params.get(f"{a}q_norm.weight"), k_norm=params.get(f"{a}k_norm.weight"),
                router=None if dense else params[f"{m}gate.weight"],
                experts=None if dense else [
                    (_fuse(params, [f"{m}experts.{e}.gate_proj.weight", f"{m}experts.{e}.up_proj.weight"]),
                     params[f"{m}experts.{e}.down_proj.weight"]) for e in range(self.num_experts)]))
        self._pool: list[tuple[torch.Tensor, torch.Tensor]] = []  # the decode batch's K/V (see decode)
        self._cap = 0
        self._seated: list[Sequence] = []  # the sequence of each used row of the pool, in row order
        self._gemv = gemv.kernel(self.embed.dtype) if decode_kernel == "c" else None
        self.gemv_target = gemv.target() if self._gemv is not None else None  # what it was built for
        self._onednn = _use_onednn(self.embed.dtype)
        self._decoding = False  # set by decode(): its batch sizes are bounded, a prompt's lengths are not
        self.lora: AdapterBank | None = None  # the engine's LoRA adapters (engine_lora.py), when it serves them
        self._rows: RowSlots | None = None  # this call's rows with an adapter (None: the base alone, nothing extra)
        self.group = self.n_heads // self.n_kv
        self.scale = self.head_dim ** -0.5
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim

    # ------------------------------------------------------------------ pieces
    def _fused(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows (a decode step's few) go through gemv.c, with its neighbouring ops folded in."""
        return self._gemv is not None and x.shape[0] <= gemv.MAX_ROWS

    def _norm_linear(self, x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """linear(rms_norm(x))"""
        if self._fused(x):
            return self._gemv(x, weight, bias, norm=norm, eps=self.eps)
        return self._torch_linear(self._norm(x, norm), weight, bias)

    def _residual_linear(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """x + linear(h)"""
        if self._fused(h):
            return self._gemv(h, weight, bias, resid=x)
        return x + self._torch_linear(h, weight, bias)

    def _torch_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What gemv.c does not take: oneDNN in fp32 for a decode step (any batch) and up to MAX_ROWS rows,
        F.linear for longer prompts and in bf16 (see _use_onednn)."""
        if self._onednn and (self._decoding or x.shape[0] <= gemv.MAX_ROWS):
            return _onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in one op (torch computes its statistics in fp32 for bf16 input too, as HF does)."""
        return F.rms_norm(x, weight.shape, weight, self.eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream [N, H] -> q [N, nh, hd], k and v [N, nkv, hd], normed (qwen3) and rotated."""
        n = x.shape[0]
        heads = self._norm_linear(x, layer.in_norm, layer.qkv, layer.qkv_bias)
        if self._rows is not None:
            heads = self.lora.add_delta(heads, layer.index, "qkv", self._norm(x, layer.in_norm), self._rows)
        heads = heads.view(n, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = heads[:, : self.n_heads + self.n_kv], heads[:, self.n_heads + self.n_kv:]
        if layer.q_norm is not None:
            qk = torch.cat((self._norm(qk[:, : self.n_heads], layer.q_norm),
                            self._norm(qk[:, self.n_heads:], layer.k_norm)), dim=1)
        qk = self._rope(qk, cos[:, None, :], sin[:, None, :])  # q and k heads rotated in one go
        return qk[:, : self.n_heads], qk[:, self.n_heads:], v

    def _attention_out(self, layer: _Layer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """x + o_proj(att), the adapters' o_proj deltas included."""
        out = self._residual_linear(x, att, layer.o, layer.o_bias)
        return out if self._rows is None else self.lora.add_delta(out, layer.index, "o", att, self._rows)

    def _moe(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x + the MoE block (Qwen3-MoE, as HF computes it): softmax over the router's logits in fp32, top-k,
        weights renormalised when ``norm_topk_prob``; each chosen expert's SwiGLU over its tokens, weighted and
        summed. The top-k ids are appended to ``self.routes`` (SGLang's routed experts)."""
        h = self._norm(x, layer.post_norm)
        probs = F.softmax(F.linear(h, layer.router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.moe_topk, dim=-1)
        if self.moe_norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if self.routes is not None:
            self.routes.append(ids)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            gate_up, down = layer.experts[e]
            gate, up = self._torch_linear(h[token], gate_up, None).chunk(2, dim=-1)
            y = self._torch_linear(F.silu(gate) * up, down, None)
            out.index_add_(0, token, y * weights[token, slot, None])
        return x + out

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if layer.router is not None:
            return self._moe(layer, x)
        gate_up = self._norm_linear(x, layer.post_norm, layer.gate_up, None)
        if self._rows is not None:  # the adapters need down_proj's input itself: no silu folded into the matmul
            gate_up = self.lora.add_delta(gate_up, layer.index, "gate_up", self._norm(x, layer.post_norm), self._rows)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            out = self._gemv(act, layer.down, resid=x) if self._fused(act) else x + self._torch_linear(act, layer.down,
                                                                                                       None)
            return self.lora.add_delta(out, layer.index, "down", act, self._rows)
        if self._fused(gate_up):
            return self._gemv(gate_up, layer.down, silu_mul=True, resid=x)
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self._torch_linear(F.silu(gate) * up, layer.down, None)

    def _positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(positions, self.embed.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm_linear(x, self.final_norm, self.lm_head, None)

    # ------------------------------------------------------------------ passes
    def prefill(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], all_logits: bool = False,
                start: int = 0, lora_slot: int = 0, images: Images = None, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Run one sequence's ``ids[start:]``, writing their K/V into ``kv`` (per layer [nkv, cap, hd], cap >=
        len(ids)), whose first ``start`` positions already hold ``ids[:start]``'s (a reused prefix); returns
        the logits of every computed position, or of the last only. ``lora_slot``: its adapter (0: the base).
        A vision-language prompt's ``images``: (positions, embeddings) that replace those positions' token
        embeddings; ``positions``: its mRoPE positions [3, len(ids)] (engine_vision.rope_index)."""
        self._rows = RowSlots.of([lora_slot]) if self.lora is not None else None
        self._start_routes()
        try:
            return self._prefill(ids, kv, all_logits, start, images, positions)
        finally:
            self._rows = None
            self._end_routes()

    def _prefill(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], all_logits: bool,
                 start: int, images: Images, positions: torch.Tensor | None) -> torch.Tensor:
        n, new = len(ids), len(ids) - start
        x = F.embedding(torch.tensor(ids[start:]), self.embed)
        if images is not None:
            x[images[0] - start] = images[1].to(x.dtype)
        cos, sin = self._positions(torch.arange(start, n) if positions is None else positions[:, start:n])
        for layer, (kb, vb) in zip(self.layers, kv, strict=True):
            q, k, v = self._qkv(layer, x, cos, sin)
            kb[:, start:n] = k.transpose(0, 1)
            vb[:, start:n] = v.transpose(0, 1)
            att = self._prefill_attention(q.transpose(0, 1)[None], kb[None], vb[None], start, n)  # [1, nh, new, hd]
            x = self._mlp(layer, self._attention_out(layer, x, att[0].transpose(0, 1).reshape(new, self.q_size)))
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

        The running batch's K/V live in one padded buffer per layer, [rows, nkv, cap, hd], the batch in its
        first B rows (``seq.kv`` are views of its row). Attention is then one batched op per layer whatever B
        is. When the batch's members change, only the change is copied (``_seat``): a leaving sequence's row
        is filled by the last row's, a joining one's K/V is copied into a free row. The buffer is rebuilt
        (every member copied once) only when the batch outgrows its rows or a sequence its ``cap`` (which
        doubles), or when it is far larger than the batch needs: amortised over the steps in between."""
        rows, order = self._seat(batch)
        self._decoding = True
        self._rows = RowSlots.of([s.lora_slot for s in rows]) if self.lora is not None else None
        self._start_routes()
        try:
            logits = self._decode(rows)
        finally:
            self._decoding = False
            self._rows = None
            self._end_routes()
        if order is None:
            return logits
        if self.last_routes is not None:  # back in the batch's order
            self.last_routes = self.last_routes[order]
        return logits[order]

    def _start_routes(self) -> None:
        self.routes, self.last_routes = ([] if self.num_experts else None), None

    def _end_routes(self) -> None:
        """``last_routes``: the call's routed experts, int32 [positions, layers, top-k] (None for a dense model)."""
        if self.routes:
            self.last_routes = torch.stack(self.routes, dim=1).to(torch.int32)
        self.routes = None

    def _decode(self, batch: list[Sequence]) -> torch.Tensor:
        """``batch``: the sequences of rows 0 .. B - 1 of the buffer, in row order (``_seat``)."""
        n = len(batch)
        pos = torch.tensor([s.kv_len for s in batch])
        rows = torch.arange(n)
        length = int(pos.max()) + 1
        mask = None  # a lone sequence sees its whole buffer up to ``length``: no mask
        if n > 1:
            hidden = torch.arange(length)[None, :] > pos[:, None]  # [B, L]: positions a sequence does not have
            mask = torch.zeros((n, 1, 1, length), dtype=self.embed.dtype).masked_fill_(hidden[:, None, None, :],
                                                                                       float("-inf"))
        x = F.embedding(torch.tensor([s.output_ids[-1] for s in batch]), self.embed)
        cos, sin = self._positions(pos + torch.tensor([s.rope_delta for s in batch]) if self._mrope else pos)
        at = int(pos[0])
        for layer, (kp, vp) in zip(self.layers, self._pool, strict=True):
            q, k, v = self._qkv(layer, x, cos, sin)
            if n == 1:  # a plain copy; indexing by tensors costs an index_put per layer
                kp[0, :, at].copy_(k[0])
                vp[0, :, at].copy_(v[0])
            else:
                kp[rows, :, pos] = k
                vp[rows, :, pos] = v
            att = F.scaled_dot_product_attention(q[:, :, None], kp[:n, :, :length], vp[:n, :, :length],
                                                 attn_mask=mask, enable_gqa=True)  # [B, nh, 1, hd]
            x = self._mlp(layer, self._attention_out(layer, x, att.reshape(n, self.q_size)))
        for s in batch:
            s.kv_len += 1
        return self._logits(x)

    def _seat(self, batch: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
        """Put ``batch``'s K/V in rows 0 .. B - 1 of the buffer; returns the batch in row order and each batch
        member's row (None when the batch is in row order). Rows past a sequence's ``kv_len`` are masked but must
        stay finite (a NaN there turns the masked score into NaN): fresh buffers are zeroed, and so is a joining
        sequence's row past its own K/V."""
        need = max(s.kv_len for s in batch) + 1
        present = {id(s) for s in batch}
        reads = [self._in_row(s, r) for r, s in enumerate(self._seated)]  # row r still holds its sequence's K/V
        held = [read and id(s) in present for read, s in zip(reads, self._seated, strict=True)]
        n_kept, rows = sum(held), self._pool[0][0].shape[0] if self._pool else 0
        # a rebuild also when a sequence not in this batch still reads its row (none does in the engine's loop,
        # which decodes every running sequence): a new buffer leaves the old one to it, as reuse would not; and
        # when the buffer is over twice what this batch would get, in rows or length: memory is given back after
        # a burst or a long generation, and a batch that shrinks and grows by one does not rebuild each time
        away = any(read and not kept for read, kept in zip(reads, held, strict=True))
        oversized = rows > 2 * _rows_for(len(batch)) or self._cap > 2 * _cap_for(batch, need)
        if need > self._cap or len(batch) > rows or away or oversized:
            self._rebuild(batch, need)
            return batch, None
        # the kept ones move down into the rows of those that left, so rows 0 .. n_kept - 1 are theirs
        seated = self._seated[:n_kept]
        holes = [r for r in range(n_kept) if not held[r]]
        movers = [r for r in range(n_kept, len(self._seated)) if held[r]]
        for dst, src in zip(holes, movers, strict=True):
            for kp, vp in self._pool:
                kp[dst].copy_(kp[src])
                vp[dst].copy_(vp[src])
            seated[dst] = self._seated[src]
        kept = {id(s) for s in seated}
        for r, s in enumerate([s for s in batch if id(s) not in kept], start=n_kept):  # the joiners
            self._copy_in(self._pool, r, s)
            for kp, vp in self._pool:
                kp[r, :, s.kv_len:].zero_()
                vp[r, :, s.kv_len:].zero_()
            seated.append(s)
        for r, s in enumerate(seated):
            if not self._in_row(s, r):
                s.kv = [(kp[r], vp[r]) for kp, vp in self._pool]
        self._seated = seated
        if all(a is b for a, b in zip(batch, seated, strict=True)):
            return batch, None
        row_of = {id(s): r for r, s in enumerate(seated)}
        return seated, [row_of[id(s)] for s in batch]

    def _rebuild(self, batch: list[Sequence], need: int) -> None:
        """A new batch buffer holding every member's K/V so far, with room to grow: its length doubles, its rows
        are the batch's and a quarter more (a growing batch is not rebuilt at every join)."""
        cap, n_rows = _cap_for(batch, need), _rows_for(len(batch))
        pool = [(self.embed.new_zeros((n_rows, self.n_kv, cap, self.head_dim)),
                 self.embed.new_zeros((n_rows, self.n_kv, cap, self.head_dim))) for _ in self.layers]
        for b, s in enumerate(batch):
            self._copy_in(pool, b, s)
            s.kv = [(kp[b], vp[b]) for kp, vp in pool]
        self._pool, self._cap = pool, cap
        self._seated = list(batch)

    @staticmethod
    def _copy_in(pool: list[tuple[torch.Tensor, torch.Tensor]], r: int, s: Sequence) -> None:
        """``s``'s K/V so far into row ``r`` of ``pool``."""
        for (kp, vp), (kb, vb) in zip(pool, s.kv, strict=True):
            kp[r, :, : s.kv_len] = kb[:, : s.kv_len]
            vp[r, :, : s.kv_len] = vb[:, : s.kv_len]

    def _in_row(self, s: Sequence, r: int) -> bool:
        """Whether ``s``'s K/V are row ``r`` of the buffer (not a new prefill's, nor a finished one's none)."""
        return bool(s.kv) and s.kv[0][0].data_ptr() == self._pool[0][0][r].data_ptr()

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.n_kv * self.head_dim * self.embed.element_size()

    def new_kv(self, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Empty per-layer K/V buffers for one sequence."""
        return [(self.embed.new_empty((self.n_kv, capacity, self.head_dim)),
                 self.embed.new_empty((self.n_kv, capacity, self.head_dim))) for _ in self.layers]


def _rows_for(n: int) -> int:
    """Rows of a decode batch buffer made for ``n`` sequences."""
    return n + max(1, n // 4)


def _cap_for(batch: list[Sequence], need: int) -> int:
    """Length of a decode batch buffer made for ``batch`` when its longest needs ``need`` positions: the next power of
    two past ``need`` with some room (at least 64), at most what the batch's sequences reserved."""
    cap = max(64, 1 << (need + 8).bit_length())
    return min(cap, max(need + 1, max(s.reserved_tokens for s in batch))) if batch else cap


def _use_onednn(dtype: torch.dtype) -> bool:
    """fp32 matmuls that gemv.c does not take go through oneDNN where their shapes are few: a decode step's
    (its batch size is at most max_running_requests) and up to MAX_ROWS rows. Over SmolLM2's 120 layer
    matrices at one row, out of cache, MKL's fp32 path (F.linear's) read the weights at 17.6 GB/s on the
    2-core AMD EPYC the benchmarks ran on, oneDNN at 28-31; at 32 rows SmolLM2 decoded 301 tok/s on F.linear,
    508-595 on oneDNN. Not a prompt's: oneDNN builds and keeps a primitive per shape, and prompts of every
    length through it grew an engine's memory for minutes (soak, 2 engines: +40 MB in 75 s and still
    growing; with F.linear flat after 15 s). bf16 stays on F.linear (oneDNN's bf16 is no faster on the plain
    layout)."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through oneDNN, on the weight as it is stored (no packed copy: it reads the live tensor,
    so a weight update copied into it is what the next call computes with)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
