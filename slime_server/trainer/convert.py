"""Hugging Face <-> Megatron-core weight mapping for Llama / Qwen2 / Qwen3 (exact, bit for bit).

Layout facts this module encodes:
- Megatron's ``linear_qkv`` stores q, k, v interleaved per KV group: for each of the G groups,
  its (heads/G) query heads, then its key head, then its value head (rows of head_dim).
- ``linear_fc1`` is [gate; up] stacked on the output dim; ``linear_fc2`` is down_proj.
- Norms: the local spec has ``input_layernorm`` / ``pre_mlp_layernorm`` modules; the
  TransformerEngine spec fuses them into ``linear_qkv.layer_norm_weight`` /
  ``linear_fc1.layer_norm_weight`` (``fused_norms=True``). Qwen3 qk-norm is ``q_layernorm`` /
  ``k_layernorm``.
- Mixture of experts (Qwen3-MoE): ``mlp.router.weight`` is HF's ``mlp.gate.weight``; expert e's
  ``mlp.experts.local_experts.<e>.linear_fc1`` / ``linear_fc2`` are its [gate; up] and down (HF's on-disk
  ``mlp.experts.<e>.gate_proj`` ...), split over TP like the dense MLP's; full state dicts use GLOBAL expert
  indices (an expert-parallel rank's local expert i is global ``ep_rank * local_count + i``). An MoE layer's MLP
  norm is ``pre_mlp_layernorm`` in both specs (nothing to fuse it into).
- Embedding / output rows are padded with zeros to ``arch.padded_vocab_size`` and stripped on
  export.

"Full" Megatron state dicts use GLOBAL layer indices and un-sharded tensors. Tensor parallel
helpers split a full tensor for TP rank r of n and gather shards back (column-parallel: dim 0,
with gate/up split separately; row-parallel: dim 1; vocab-parallel embedding/output: dim 0).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from slime_server.trainer.lora import (
    LINEARS,
    adapter_partition_dim,
    branches,
    full_delta,
    is_adapter_name,
    part_sizes,
)
from slime_server.trainer.model import ModelArch, unwrap
from slime_server.trainer.vision import TrainerVision

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Megatron per-layer name -> HF per-layer name, for tensors that map one to one.
_ONE_TO_ONE = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_INPUT_NORM = {False: "input_layernorm.weight", True: "self_attention.linear_qkv.layer_norm_weight"}
_MLP_NORM = {False: "pre_mlp_layernorm.weight", True: "mlp.linear_fc1.layer_norm_weight"}

_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
_GATE_UP = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


# ---------------------------------------------------------------- pure tensor layout helpers


def _pad_vocab(t: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    if t.shape[0] == arch.padded_vocab_size:
        return t
    pad = t.new_zeros(arch.padded_vocab_size - t.shape[0], *t.shape[1:])
    return torch.cat([t, pad], dim=0)


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """HF q/k/v projections (weight [out, in] or bias [out]) -> Megatron linear_qkv layout."""
    g, d = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    parts = [q.reshape(g, -1, d, *tail), k.reshape(g, 1, d, *tail), v.reshape(g, 1, d, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, arch: ModelArch, out: Sequence[torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_qkv``: Megatron linear_qkv -> HF (q, k, v), new tensors or written into ``out``
    (three tensors of the HF shapes: one copy straight into them)."""
    g, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, per_group + 2, d, *tail)
    parts = grouped.split([per_group, 1, 1], dim=1)
    if out is None:
        q, k, v = (p.reshape(-1, *tail).contiguous() for p in parts)
        return q, k, v
    for dst, part in zip(out, parts, strict=True):
        dst.view(part.shape).copy_(part)
    return out[0], out[1], out[2]


def _suffix(name: str) -> str:
    """A layer tensor's name under its layer; an expert's linear as the dense MLP's (it splits over TP alike)."""
    m = _LAYER.match(name)
    suffix = m.group(2) if m else name
    e = _EXPERT.match(suffix)
    return f"mlp.{e.group(2)}.weight" if e else suffix


def split_for_tp(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The shard of a full Megatron tensor that TP rank ``tp_rank`` of ``tp_size`` holds."""
    if tp_size == 1:
        return full
    suffix = _suffix(name)
    if is_adapter_name(name):
        dim = adapter_partition_dim(name)
        return full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank].contiguous()
    if suffix in _COLUMN_PARALLEL or suffix in _VOCAB_PARALLEL:
        return full.chunk(tp_size, dim=0)[tp_rank].contiguous()
    if suffix in _ROW_PARALLEL:
        return full.chunk(tp_size, dim=1)[tp_rank].contiguous()
    if suffix in _GATE_UP:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full


def gather_from_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Full Megatron tensor from the per-rank shards (inverse of ``split_for_tp``)."""
    if len(shards) == 1:
        return shards[0]
    suffix = _suffix(name)
    if is_adapter_name(name):
        dim = adapter_partition_dim(name)
        return shards[0] if dim is None else torch.cat(shards, dim=dim)
    if suffix in _COLUMN_PARALLEL or suffix in _VOCAB_PARALLEL:
        return torch.cat(shards, dim=0)
    if suffix in _ROW_PARALLEL:
        return torch.cat(shards, dim=1)
    if suffix in _GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return shards[0]


# ---------------------------------------------------------------- whole-state-dict mapping


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], arch: ModelArch, *, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """HF state dict -> full Megatron state dict (global layer indices, vocab padded)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in hf_state:
            raise KeyError(f"HF checkpoint is missing {key!r}")
        used.add(key)
        return hf_state[key]

    out["embedding.word_embeddings.weight"] = _pad_vocab(take("model.embed_tokens.weight"), arch)
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not arch.tied_embeddings:
        out["output_layer.weight"] = _pad_vocab(take("lm_head.weight"), arch)
    elif "lm_head.weight" in hf_state:
        used.add("lm_head.weight")  # tied: the same tensor as embed_tokens
    for i in range(arch.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[mg + "self_attention.linear_qkv.weight"] = interleave_qkv(
            take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight"), arch)
        if arch.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = interleave_qkv(
                take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias"), arch)
        if arch.is_moe:
            out[mg + "mlp.router.weight"] = take(hf + "mlp.gate.weight")
            for e in range(arch.num_experts):
                h, m = f"{hf}mlp.experts.{e}.", f"{mg}mlp.experts.local_experts.{e}."
                out[m + "linear_fc1.weight"] = torch.cat([take(h + "gate_proj.weight"), take(h + "up_proj.weight")])
                out[m + "linear_fc2.weight"] = take(h + "down_proj.weight")
        else:
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")], dim=0)
            out[mg + "mlp.linear_fc2.weight"] = take(hf + "mlp.down_proj.weight")
        out[mg + _INPUT_NORM[fused_norms]] = take(hf + "input_layernorm.weight")
        out[mg + _MLP_NORM[fused_norms and not arch.is_moe]] = take(hf + "post_attention_layernorm.weight")
        for mg_name, hf_name in _ONE_TO_ONE.items():
            if ("layernorm" in mg_name and not arch.qk_norm) or mg_name == "mlp.linear_fc2.weight":
                continue
            out[mg + mg_name] = take(hf + hf_name)
    unused = sorted(k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise KeyError(f"HF tensors with no Megatron counterpart: {unused[:8]}")
    return out


Staging = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def megatron_tensor_to_hf(
    name: str, tensor: torch.Tensor, arch: ModelArch, staging: Staging | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor (global layer index) -> its HF (name, tensor) pairs. Most are views of
    ``tensor``; what must be converted (q/k/v, split out of the fused layout) is new, or written into
    ``staging(hf_name, shape, dtype)``'s tensor when given (a push's shared-memory buffers)."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: arch.vocab_size])]
    if name == "output_layer.weight":
        return [] if arch.tied_embeddings else [("lm_head.weight", tensor[: arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"unknown Megatron tensor {name!r}")
    hf, suffix = f"model.layers.{m.group(1)}.", m.group(2)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        names = [f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"]
        out = None
        if staging is not None and tensor.device.type == "cpu":  # shared memory is host memory
            d, g = arch.head_dim, arch.num_kv_heads
            rows = (arch.num_heads * d, g * d, g * d)
            out = [staging(n, (r, *tensor.shape[1:]), tensor.dtype) for n, r in zip(names, rows, strict=True)]
        return list(zip(names, split_qkv(tensor, arch, out), strict=True))
    if suffix == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(hf + "mlp.gate_proj.weight", gate.contiguous()), (hf + "mlp.up_proj.weight", up.contiguous())]
    if suffix == "mlp.router.weight":
        return [(hf + "mlp.gate.weight", tensor)]
    expert = _EXPERT.match(suffix)
    if expert:
        h = f"{hf}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc2":
            return [(h + "down_proj.weight", tensor)]
        gate, up = tensor.chunk(2, dim=0)
        return [(h + "gate_proj.weight", gate.contiguous()), (h + "up_proj.weight", up.contiguous())]
    if suffix in _INPUT_NORM.values():
        return [(hf + "input_layernorm.weight", tensor)]
    if suffix in _MLP_NORM.values():
        return [(hf + "post_attention_layernorm.weight", tensor)]
    if suffix in _ONE_TO_ONE:
        return [(hf + _ONE_TO_ONE[suffix], tensor)]
    raise KeyError(f"unknown Megatron tensor {name!r}")


def megatron_to_hf(mg_state: Mapping[str, torch.Tensor], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Megatron state dict -> stream of (HF name, tensor). ``_extra_state`` entries are skipped."""
    for name, tensor in mg_state.items():
        if name.endswith("_extra_state") or tensor is None:
            continue
        yield from megatron_tensor_to_hf(name, tensor, arch)


# ---------------------------------------------------------------- live model I/O


def layer_offset(model: nn.Module) -> tuple[int, int]:
    """Global index of this pipeline stage's first layer (Megatron names layers per stage) and of this
    expert-parallel rank's first expert (Megatron names experts per rank)."""
    from megatron.core import parallel_state as ps

    layers = model.decoder.layers
    first_layer = layers[0].layer_number - 1 if len(layers) else 0
    experts = getattr(getattr(model, "arch", None), "num_experts", 0)
    ep = ps.get_expert_model_parallel_world_size() if experts else 1
    return first_layer, (ps.get_expert_model_parallel_rank() * (experts // ep) if experts else 0)


def to_global(name: str, offset: tuple[int, int]) -> str:
    """A stage's (rank's) parameter name with global layer (and expert) indices."""
    m = _LAYER.match(name)
    if not m:
        return name
    suffix = m.group(2)
    e = _EXPERT.match(suffix)
    if e:
        suffix = f"mlp.experts.local_experts.{int(e.group(1)) + offset[1]}.{e.group(2)}.weight"
    return f"decoder.layers.{int(m.group(1)) + offset[0]}.{suffix}"


def uses_fused_norms(model: nn.Module) -> bool:
    """True for the TransformerEngine spec (norms fused into linear_qkv / linear_fc1)."""
    return any(n.endswith("layer_norm_weight") for n, _ in unwrap(model).named_parameters())


def global_parameter_names(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(global Megatron name, parameter) for this stage's parameters; a last stage's copy of tied embeddings is
    left out (the first stage's embedding is the tensor, and their updates are the same)."""
    inner = unwrap(model)
    offset = layer_offset(inner)
    for name, param in inner.named_parameters():
        key = to_global(name, offset)
        if key == "output_layer.weight" and inner.arch.tied_embeddings:
            continue
        yield key, param


def megatron_shards(model: nn.Module, full_state: Mapping[str, torch.Tensor], *, trainable_only: bool = False,
                    ) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, its shard of ``full_state``) for this rank's (TP shard, PP stage) parameters: a full Megatron
    state dict (weights, or anything shaped like them: Adam moments) cut to this layout. ``trainable_only``: the
    parameters that train (a LoRA job's adapters), not the frozen base."""
    from megatron.core import parallel_state as ps

    inner = unwrap(model)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    offset = layer_offset(inner)
    for name, param in inner.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        key = to_global(name, offset)
        if key == "output_layer.weight" and inner.arch.tied_embeddings:
            key = "embedding.word_embeddings.weight"  # last PP stage's copy of the tied embedding
        if key not in full_state:
            raise KeyError(f"checkpoint has no tensor for parameter {key!r}")
        full = full_state[key]
        if key in _VOCAB_PARALLEL:
            full = _pad_vocab(full[: inner.arch.vocab_size], inner.arch)
        shard = split_for_tp(key, full, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{key}: checkpoint shard {tuple(shard.shape)} != parameter {tuple(param.shape)}")
        yield param, shard


def load_megatron_state_into(model: nn.Module, full_state: Mapping[str, torch.Tensor]) -> None:
    """Copy a full Megatron state dict into this rank's (TP shard, PP stage) parameters."""
    with torch.no_grad():
        for param, shard in megatron_shards(model, full_state):
            param.copy_(shard)


def read_hf_state_dict(hf_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (one or many ``*.safetensors`` files)."""
    from safetensors.torch import load_file

    files = sorted(Path(hf_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_hf_checkpoint_into(model: nn.Module, hf_path: str | Path) -> None:
    """Load an HF checkpoint directory into a GPTModel built by ``build_gpt_model``; a vision-language checkpoint's
    frozen vision tower beside it, as ``model.vision`` (trainer/vision.py; not a parameter of the model)."""
    inner = unwrap(model)
    state = read_hf_state_dict(hf_path)
    if inner.arch.mrope_section is not None:
        state = {k: v for k, v in state.items() if not k.startswith("visual.")}
        inner.vision = TrainerVision(str(hf_path), next(inner.parameters()).dtype)
    full = hf_to_megatron(state, inner.arch, fused_norms=uses_fused_norms(inner))
    load_megatron_state_into(inner, full)


def iter_hf_tensors(model: nn.Module, staging: Staging | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream this PP stage's weights as (HF name, full tensor), all-gathering TP shards.

    Every rank of the TP group must iterate (the gathers are collectives); all get full tensors.
    Most tensors (all but q/k/v at TP = 1) are views of the live parameters: copy them (e.g. into a
    bucket) before the next optimizer step. ``staging``: see ``megatron_tensor_to_hf``. A LoRA model's adapted
    weights come merged (``W + scaling * B A``, computed in fp32): what an engine that takes no adapter serves.
    """
    inner = unwrap(model)
    offset = layer_offset(inner)
    adapted = {path: b for path, b in branches(inner) if b.enabled}  # inside adapters_disabled: the base alone
    for name, param in inner.named_parameters():
        if is_adapter_name(name):
            continue  # merged into its base weight below
        key = to_global(name, offset)
        full = gather_tp(key, param, param.detach())
        linear = name.removesuffix(".weight")
        if linear in adapted:
            full = full + _adapter_delta(inner, linear, offset).to(full.device, full.dtype)
        for expert_key, tensor in gather_ep(key, full, inner.arch):
            yield from megatron_tensor_to_hf(expert_key, tensor, inner.arch, staging)


def gather_ep(key: str, tensor: torch.Tensor, arch: ModelArch) -> list[tuple[str, torch.Tensor]]:
    """An expert's tensor from every expert-parallel rank (a collective of the EP group): EP rank r's local expert
    i is global expert ``r * local + i``, named so; anything else, or EP = 1, is (key, tensor) itself."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    m = _LAYER.match(key)
    e = _EXPERT.match(m.group(2)) if m else None
    ep = ps.get_expert_model_parallel_world_size() if arch.is_moe else 1
    if e is None or ep == 1:
        return [(key, tensor)]
    local = arch.num_experts // ep
    index = int(e.group(1)) % local  # the global name of this rank's expert, back to its local slot
    pieces = [torch.empty_like(tensor) for _ in range(ep)]
    dist.all_gather(pieces, tensor.contiguous(), group=ps.get_expert_model_parallel_group())
    return [(f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{r * local + index}.{e.group(2)}.weight", t)
            for r, t in enumerate(pieces)]


def _adapter_delta(inner: nn.Module, linear: str, offset: int) -> torch.Tensor:
    """The full ``scaling * B A`` of the adapters on ``linear`` (a local module path), TP shards gathered (collective
    of the TP group), in the base weight's layout: what merging the adapter adds to that weight."""
    branch = inner.get_submodule(linear).lora
    if branch.stacked:
        raise ValueError("a multi-adapter trainer has no one merged model: publish each adapter (lora.publish "
                         "'adapter')")
    pairs = {}
    for part, pair in branch.pairs.items():
        full_ab = []
        for matrix in ("lora_A", "lora_B"):
            param = getattr(pair, matrix)
            key = to_global(f"{linear}.lora.{part}.{matrix}", offset)
            full_ab.append(gather_tp(key, param, param.detach()))
        pairs[part] = (full_ab[0], full_ab[1])
    suffix = next(s for s in LINEARS if linear.endswith(s))
    groups = inner.arch.num_kv_heads if suffix.endswith("linear_qkv") else 0
    return full_delta(branch, pairs, part_sizes(inner.arch, suffix), groups)


def gather_tp(key: str, param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard of ``param``, or a tensor laid out like it: an Adam moment) as the full tensor,
    its TP shards all-gathered (a collective of the TP group); replicated parameters come back as they are."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return gather_from_tp(key, shards)


def export_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as an HF state dict (CPU tensors, cloned)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in iter_hf_tensors(model)}

