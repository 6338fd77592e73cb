"""Deterministic tiny Qwen3-architecture model + byte-level BPE tokenizer, built locally.

Why: the CPU default and every test need a real Hugging Face checkpoint (config.json,
safetensors, tokenizer.json with a chat template) without any network access. The builder
trains a byte-level BPE tokenizer on a synthetic corpus and initialises a small Qwen3
model from a seed, then saves both with ``save_pretrained``; everything downstream loads
it with the same ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` calls a real
checkpoint uses.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

BUILDER_VERSION = "2"
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

# Qwen-style specials: the first three are control tokens (skipped when decoding), the
# rest are ordinary added tokens that stay visible in decoded text (parsers need them).
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Qwen2's pre-tokenizer regex: single digits, words with one leading non-letter, punctuation runs.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TinyModelSpec(BaseModel):
    """Shape of the tiny model; the defaults give ~3.4 M parameters."""

    seed: int = 0
    max_bpe_vocab: int = 2048  # upper bound for BPE training; config vocab = len(tokenizer) rounded up
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    # Mixture of experts (Qwen3-MoE architecture): 0 = the dense Qwen3 model
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 192
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def tiny_moe_spec() -> TinyModelSpec:
    """The tiny MoE: the dense tiny model's shape with every MLP 8 experts, top-2 (~5.5 M parameters)."""
    return TinyModelSpec(num_experts=8)


def default_cache_dir() -> Path:
    root = os.environ.get("SLIME_SERVER_CACHE") or os.path.join(Path.home(), ".cache", "slime-server")
    return Path(root) / "models"


def _stable_name(spec: TinyModelSpec) -> str:
    # hash() is salted per process; use a stable digest of the spec instead.
    import hashlib

    moe_fields = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"}
    # the dense model's name predates the MoE fields: leave them out of its digest so its caches stay valid
    digest = hashlib.sha256(spec.model_dump_json(exclude=None if spec.is_moe else moe_fields).encode()).hexdigest()
    return f"tiny-qwen3{'moe' if spec.is_moe else ''}-v{BUILDER_VERSION}-{digest[:10]}"


def ensure_tiny_model(cache_dir: str | Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Return the path of the tiny model, building it once (process-safe) if absent."""
    spec = spec or TinyModelSpec()
    return build_once(Path(cache_dir) if cache_dir else default_cache_dir(), _stable_name(spec),
                      lambda out: build_tiny_model(out, spec))


def build_once(root: Path, name: str, build: Callable[[Path], object]) -> Path:
    """``root / name``, made by ``build(tmp)`` once (process-safe: under a lock, into a temporary directory renamed
    into place when complete) if it has no ``config.json`` yet."""
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if (target / "config.json").exists():
        return target
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            build(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build tokenizer + model deterministically from ``spec.seed`` into ``out_dir``."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    tokenizer.save_pretrained(out)
    model = build_model(spec, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    (out / "slime_tiny_spec.json").write_text(spec.model_dump_json(indent=2))
    return out


def build_tokenizer(spec: TinyModelSpec):
    """Train a byte-level BPE on a synthetic corpus; wrap it as a HF fast tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_added = len(CONTROL_TOKENS) + len(MARKUP_TOKENS)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.max_bpe_vocab - n_added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(spec.seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE_PATH.read_text()
    return fast


def build_model(spec: TinyModelSpec, tokenizer):
    """Initialise a Qwen3ForCausalLM (Qwen3MoeForCausalLM with ``spec.num_experts``) from the seed (weights depend
    on nothing else)."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # Like Qwen's checkpoints, the embedding is padded past the tokenizer (here to 128).
    vocab_size = -(-len(tokenizer) // 128) * 128
    moe = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
               moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=spec.norm_topk_prob,
               decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if spec.is_moe else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        **(moe if spec.is_moe else {}),
    )
    torch.manual_seed(spec.seed)
    model = model_cls(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id
    )
    return model


# --------------------------------------------------------------------------- corpus

_WORDS = (
    "the a an of to and in is it you that he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look two "
    "more write go see number no way could people my than first water been call who oil its now find long "
    "down day did get come made may part answer question result tool call function search python code "
    "calculator add subtract multiply divide sum total price apples books cost left each more fewer "
    "document title text query find read file return value true false error hello assistant user system "
    "please thanks sure here is the answer compute what is how many buy sell give take has have"
).split()
_TOOL_NAMES = ["calculator", "search", "python", "get_weather", "lookup", "run_code"]
# Instruction text the chat template and the built-in environments put in every prompt: in the
# corpus so BPE merges it and prompts stay short (the CPU demo trains on them; shorter is faster).
_INSTRUCTIONS = [
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:",
    '{"name": <function-name>, "arguments": <args-json-object>}',
    "Solve the problem. Use the calculator tool for arithmetic, then state the final answer as a number.",
    "Evaluate an arithmetic expression such as (3 + 4) * 2.",
    "Write Python code. You may run code with the python tool. Give the final code in a ```python block.",
    "Answer the question. Use the search tool to find facts. Give the final answer in <answer></answer>.",
    "You are a helpful assistant.",
    "has apples and buys more. How many apples does have now? had coins and spent. How many coins are left?",
    "A box holds pencils. How many pencils are in boxes? cookies are shared equally among children. "
    "How many does each child get? The answer is",
]


def synthetic_corpus(seed: int, n_lines: int = 6000):
    """Yield deterministic training text: prose, arithmetic, JSON tool calls, code."""
    rng = random.Random(seed)
    for i in range(n_lines):
        kind = i % 6
        if kind == 0:
            yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))).capitalize() + "."
        elif kind == 1:
            a, b = rng.randint(0, 9999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*", "/"])
            yield f"What is {a} {op} {b}? The answer is {a} {op} {b} = {rng.randint(0, 99999)}."
        elif kind == 2:
            name = rng.choice(_TOOL_NAMES)
            args = {"expression": f"{rng.randint(1, 999)} * {rng.randint(1, 99)}"} if rng.random() < 0.5 else {
                "query": " ".join(rng.choice(_WORDS) for _ in range(3))
            }
            yield "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        elif kind == 3:
            schema = {"type": "function", "function": {"name": rng.choice(_TOOL_NAMES),
                      "description": " ".join(rng.choice(_WORDS) for _ in range(6)),
                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                     "required": ["expression"]}}}
            yield json.dumps(schema)
        elif kind == 4:
            yield " ".join(rng.sample(_INSTRUCTIONS, 3))
        else:
            v = rng.choice(["x", "y", "total", "n", "result"])
            yield (f"def f({v}):\n    return {v} * {rng.randint(2, 9)} + {rng.randint(0, 9)}\n"
                   f"print(f({rng.randint(0, 99)}))")
