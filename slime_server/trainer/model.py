"""Build a Megatron-core ``GPTModel`` from a Hugging Face config, and run it on token ids.

Supported families: Llama, Qwen2 (qkv bias) and Qwen3 (qk-norm, explicit head_dim), with GQA,
tied or untied embeddings, RoPE base, RMSNorm eps and SwiGLU taken from the HF config.
The local (pure Megatron-core) layer spec is used on CPU; the TransformerEngine spec when TE is
importable and a GPU is present. Vocabulary rows are padded only as far as tensor parallelism
needs (a multiple of the TP size) and ``forward_logits`` slices logits back to the HF vocab.

``forward_logits`` owns the mask convention (Megatron: True = masked out) and supports
PACKED rows: several samples concatenated with position ids restarting at 0 per sample get a
block-diagonal causal mask and RoPE at their own positions, so packed == unpacked exactly.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from slime_server.trainer import routing_replay
from slime_server.trainer.adapter_rows import rows_through
from slime_server.trainer.megatron_cpu import apply_cpu_patches, cuda_available

if TYPE_CHECKING:
    from slime_server.trainer.packing import MicroBatch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl")
VISION_LANGUAGE_TYPES = ("qwen2_5_vl",)  # trained as their language model (Qwen2 with mRoPE), the vision tower frozen


@dataclass(frozen=True)
class ModelArch:
    """The architecture facts conversion and logits slicing need, read once from the HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # Llama 3.1+ RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None = None
    # Mixture of experts (Qwen3-MoE: every layer's MLP is ``num_experts`` SwiGLU experts, top-k routed); 0 = dense
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = False  # renormalise the top-k softmax weights to sum to 1 (Qwen3's norm_topk_prob)
    # a vision-language model's mRoPE: the temporal, height and width sections of the rotary frequencies (None: RoPE)
    mrope_section: tuple[int, ...] | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _rope(hf_config: Any) -> tuple[float, tuple[float, float, float, int] | None]:
    """RoPE base and Llama-3 scaling from either transformers layout (``rope_theta``/``rope_scaling`` or 5.x
    ``rope_parameters``); other scaling types (yarn, linear, dynamic) are refused, not approximated."""
    theta = getattr(hf_config, "rope_theta", None)
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    llama3 = None
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "llama3":
            llama3 = (float(params["factor"]), float(params.get("low_freq_factor", 1.0)),
                      float(params.get("high_freq_factor", 4.0)), int(params["original_max_position_embeddings"]))
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported RoPE scaling type {rope_type!r} (default and llama3 only)")
        theta = params.get("rope_theta", theta)
    return float(theta if theta is not None else 10000.0), llama3


def arch_from_hf_config(hf_config: Any, tp_size: int = 1) -> ModelArch:
    """Read a transformers Llama/Mistral/Qwen2/Qwen3 config; reject anything this mapping cannot represent."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
    mrope = None
    if model_type in VISION_LANGUAGE_TYPES:  # the language model's config; its tied embeddings are the top config's
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        hf_config = hf_config.get_text_config()
        hf_config.tie_word_embeddings = tied
        mrope = tuple(int(x) for x in (getattr(hf_config, "rope_parameters", None) or {})["mrope_section"])
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r} (SwiGLU/silu only)")
    if getattr(hf_config, "mlp_bias", False) or getattr(hf_config, "attention_bias", False):
        raise ValueError("bias on MLP or attention projections is not supported (Qwen2 qkv bias is)")
    window = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
    if getattr(hf_config, "use_sliding_window", False) or (window and window < hf_config.max_position_embeddings):
        raise ValueError("sliding-window attention is not supported")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if num_heads % tp_size or num_kv_heads % tp_size:
        raise ValueError(f"heads ({num_heads}) and kv heads ({num_kv_heads}) must divide by TP {tp_size}")
    qkv_bias = model_type in ("qwen2", "qwen2_5_vl")
    vocab = hf_config.vocab_size
    moe = _moe_fields(hf_config) if model_type == "qwen3_moe" else {}
    return ModelArch(
        model_type=model_type, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, vocab_size=vocab, padded_vocab_size=math.ceil(vocab / tp_size) * tp_size,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=_rope(hf_config)[0], max_position_embeddings=hf_config.max_position_embeddings,
        rope_llama3=_rope(hf_config)[1], mrope_section=mrope, **moe,
    )


def _moe_fields(hf_config: Any) -> dict[str, Any]:
    """ModelArch's MoE fields of a Qwen3-MoE config. Every layer must be an MoE layer (as in Qwen3-30B-A3B and
    -235B-A22B): dense layers between them (``decoder_sparse_step`` > 1, ``mlp_only_layers``) are refused."""
    if int(getattr(hf_config, "decoder_sparse_step", 1)) != 1 or list(getattr(hf_config, "mlp_only_layers", []) or []):
        raise ValueError("MoE models with dense MLP layers between the MoE layers (decoder_sparse_step > 1 or "
                         "mlp_only_layers) are not supported")
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    return dict(num_experts=int(experts), moe_topk=int(hf_config.num_experts_per_tok),
                moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
                moe_norm_topk=bool(getattr(hf_config, "norm_topk_prob", False)))


def _use_transformer_engine() -> bool:
    if not cuda_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _layer_spec(arch: ModelArch, use_te: bool) -> Any:
    """The layer spec; an MoE model's experts are SequentialMLP (one linear pair per expert, HF's layout): the
    grouped-GEMM experts need CUDA kernels."""
    from megatron.core.models.gpt import gpt_layer_specs

    from slime_server.trainer.block_attention import BlockAttention  # lazy: loads megatron

    experts = arch.num_experts or None
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                    qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    # a packed row's attention only on the blocks its mask leaves open (trainer/block_attention.py)
    spec.submodules.self_attention.submodules.core_attention = BlockAttention
    return spec


def moe_settings(arch: ModelArch, ep_size: int) -> dict[str, Any]:
    """TransformerConfig's MoE settings computing what HF's Qwen3-MoE block does: softmax router, top-k, weights
    renormalised when ``norm_topk_prob`` (Megatron: top-k of the logits, then softmax over the k, the same
    weights) or else the full softmax's; no token dropping, no auxiliary loss; the allgather dispatcher (the
    alltoall and flex ones call CUDA). Routing replay is ours (routing_replay.install), not Megatron's flag."""
    if arch.num_experts % ep_size:
        raise ValueError(f"{arch.num_experts} experts do not split evenly over EP={ep_size}")
    return dict(
        num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_score_function="softmax", moe_router_pre_softmax=not arch.moe_norm_topk,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, expert_model_parallel_size=ep_size,
    )


class PositionIdsRotaryEmbedding(nn.Module):
    """Wraps Megatron's RotaryEmbedding so RoPE follows explicit position ids.

    Megatron's dense (sbhd) path rotates token i by angle(i); packed rows need angle(position_id)
    because positions restart per sample. With ``positions`` set, the returned frequencies are
    [s, b, 1, d] (one row per token), which Megatron's ``apply_rotary_pos_emb`` broadcasts.
    """

    def __init__(self, inner: nn.Module, mrope_section: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.positions: torch.Tensor | None = None
        self.mrope: torch.Tensor | None = None  # a vision-language row's mRoPE positions [3, b, s] (set per forward)
        # mRoPE (HF's Qwen2.5-VL): rotary frequency j follows the temporal, height or width position by sections,
        # the same for both halves of the head (Megatron's table is cat(freqs, freqs))
        half = None if mrope_section is None else torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.axis = None if half is None else torch.cat((half, half))

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, **kwargs: Any) -> torch.Tensor:
        if self.mrope is not None:
            pos = self.mrope  # [3, b, s]
            table = self.inner(int(pos.max()) + 1, **kwargs)[:, 0, 0, :]  # [max_pos, d]
            per_axis = table[pos.transpose(1, 2)]  # [3, s, b, d]
            axis = self.axis.to(pos.device).view(1, 1, 1, -1).expand(1, *per_axis.shape[1:])
            return per_axis.gather(0, axis)[0].unsqueeze(2)  # [s, b, 1, d]
        if self.positions is None:
            return self.inner(max_seq_len, **kwargs)
        table = self.inner(int(self.positions.max()) + 1, **kwargs)[:, 0, 0, :]  # [max_pos, d]
        return table[self.positions.t()].unsqueeze(2)  # [s, b, 1, d]


def build_gpt_model(
    hf_config: Any, *, params_dtype: torch.dtype = torch.float32, use_te: bool | None = None,
    pre_process: bool | None = None, post_process: bool | None = None, parallel_output: bool = True,
    **config_overrides: Any,
) -> nn.Module:
    """A Megatron-core GPTModel matching ``hf_config``; parallel_state must be initialised.

    ``config_overrides`` go to TransformerConfig (e.g. recompute settings). The model carries
    its ``ModelArch`` as ``model.arch`` for conversion and logits slicing.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    on_cpu = not cuda_available()
    if on_cpu:
        apply_cpu_patches()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    arch = arch_from_hf_config(hf_config, tp)
    if arch.num_layers % pp:
        raise ValueError(f"{arch.num_layers} layers do not split evenly over PP={pp}")
    use_te = _use_transformer_engine() if use_te is None else use_te
    settings: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=params_dtype,
        sequence_parallel=False,
        # Fused kernels are CUDA-only (and RoPE fusion would ignore per-token positions).
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
    )
    if arch.is_moe:
        settings.update(moe_settings(arch, ps.get_expert_model_parallel_world_size()))
    settings.update(config_overrides)
    config = TransformerConfig(**settings)
    model = GPTModel(
        config=config, transformer_layer_spec=_layer_spec(arch, use_te), vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        parallel_output=parallel_output, share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rope_theta,
    )
    if arch.rope_llama3 is not None:  # Megatron's own Llama-3 rule, with this checkpoint's four numbers
        factor, low, high, original = arch.rope_llama3
        rope = model.rotary_pos_emb
        rope.inv_freq = rope._apply_scaling(rope.inv_freq, factor=factor, low_freq_factor=low,
                                            high_freq_factor=high, original_max_position_embeddings=original)
    model.rotary_pos_emb = PositionIdsRotaryEmbedding(model.rotary_pos_emb, arch.mrope_section)
    if arch.is_moe:
        routing_replay.install(model)
    model.arch = arch
    model.uses_te = use_te
    return model


def _segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Sample index of every token in a packed row: a new sample starts where positions restart."""
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] <= position_ids[:, :-1]).long()
    return starts.cumsum(dim=1)


def _is_packed(position_ids: torch.Tensor) -> bool:
    return bool((position_ids[:, 1:] <= position_ids[:, :-1]).any())


def build_attention_mask(
    position_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Megatron attention mask [b, 1, s, s], True = masked out.

    Causal within each packed sample (block-diagonal over samples found from ``position_ids``);
    keys where ``padding_mask`` (HF convention, 1 = real token) is 0 are masked too, except each
    token's own position so a padding row never has an empty softmax.
    """
    b, s = position_ids.shape
    seg = _segment_ids(position_ids)
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    allowed = causal.unsqueeze(0) & (seg.unsqueeze(2) == seg.unsqueeze(1))
    if padding_mask is not None:
        allowed &= padding_mask.bool().unsqueeze(1)
        allowed |= torch.eye(s, dtype=torch.bool, device=position_ids.device).unsqueeze(0)
    return (~allowed).unsqueeze(1)


def _mask_vocab_padding(shard: torch.Tensor, arch: ModelArch, tp_rank: int) -> torch.Tensor:
    """Push the TP padding columns (token ids >= vocab_size) of a logits shard out of any softmax.

    The dtype minimum rather than -inf keeps p * log p finite (0 * min == 0) in entropy terms.
    """
    width = shard.shape[-1]
    valid = arch.vocab_size - tp_rank * width
    if valid >= width:
        return shard
    padding = torch.arange(width, device=shard.device) >= valid
    return shard.masked_fill(padding, torch.finfo(shard.dtype).min)


def unwrap(model: nn.Module) -> nn.Module:
    """The Megatron model inside its wrappers (DDP, Float16Module: each keeps it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def forward_logits(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None, *, gather: bool = True, images: Any = None,
) -> torch.Tensor:
    """Logits [b, s, vocab] of a GPTModel (plain or DDP-wrapped) for ``input_ids`` [b, s].

    ``position_ids`` [b, s] restarting at 0 mark packed samples (default: 0..s-1 per row).
    ``attention_mask`` is either an HF padding mask [b, s] (1 = keep) or a ready Megatron mask
    [b, 1, s, s] (True = masked out). With ``gather`` the TP-sharded logits are all-gathered and
    sliced to the HF vocab size; without it the local vocab shard [b, s, padded_vocab / tp] is
    returned (for vocab-parallel losses) with its padding columns set to the dtype minimum.
    On non-last pipeline stages the hidden states are returned unchanged. Calling the model
    directly ignores ``position_ids`` for RoPE (Megatron's dense path): packed rows need this.
    ``images``: a vision-language row's ``trainer.vision.RowImages`` (mRoPE positions, and the image rows'
    embeddings that replace those tokens' in the decoder's input).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    inner = unwrap(model)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    if position_ids.shape != input_ids.shape:
        raise ValueError("position_ids must have the same shape as input_ids")
    if getattr(inner, "uses_te", False) and (attention_mask is not None or _is_packed(position_ids)):
        # TE attention runs with attn_mask_type=causal and ignores an explicit mask.
        raise NotImplementedError("packed or padded rows need the local layer spec (use_te=False)")
    if attention_mask is None or attention_mask.dim() == 2:
        attention_mask = build_attention_mask(position_ids, attention_mask)
    rope = inner.rotary_pos_emb
    rope.positions = position_ids
    extra: dict[str, Any] = {}
    if images is not None:
        rope.mrope = images.positions.to(input_ids.device)
        if inner.pre_process:
            extra["decoder_input"] = images.decoder_input(inner, input_ids, position_ids)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **extra)
    finally:
        rope.positions = rope.mrope = None
    if not inner.post_process:
        return out
    if not gather:
        return _mask_vocab_padding(out, inner.arch, ps.get_tensor_model_parallel_rank())
    if ps.get_tensor_model_parallel_world_size() > 1:
        out = gather_from_tensor_model_parallel_region(out)
    return out[..., : inner.arch.vocab_size]


def forward_micro_batch(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``forward_logits`` (local shard, ``gather=False``) of a micro-batch's rows [1, R, ...]: its token tree's
    when it has one (callers ``mb.expand`` the rows into the samples' layout), else its packed row."""
    device = next(model.parameters()).device
    tokens, position_ids, mask = mb.model_inputs()
    rows = None if mb.adapter_rows is None else mb.adapter_rows.to(device)
    replay: Any = contextlib.nullcontext()
    inner = unwrap(model)
    if mb.route_rows is not None and inner.arch.is_moe:  # each row through its recorded experts (R3)
        replay = routing_replay.replaying(model, routing_replay.stage_routes(inner, mb.route_rows))
    images = None
    if mb.images is not None:  # a vision-language micro-batch: its image inputs on the forward's rows
        if getattr(inner, "vision", None) is None:
            raise ValueError("samples carry images but the model has no vision tower (not a vision-language checkpoint)")
        images = inner.vision.row(mb.sample_lens, mb.images)
        if mb.tree is not None:
            images = images.on_rows(mb.tree.index, mb.tree.num_rows)
    with rows_through(rows), replay:  # a multi-adapter LoRA trainer: each row through its sample's adapter
        return forward_logits(model, tokens[None].to(device), position_ids[None].to(device),
                              None if mask is None else mask.to(device), gather=False, images=images)
