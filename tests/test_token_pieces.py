"""Piecewise tokenization (``gateway/token_pieces.py``): the ids of a whole text, each piece tokenized once.

Real tokenizers throughout: the tiny model's and the real checkpoint's (SmolLM2), and two built with the
``tokenizers`` library whose pieces do NOT tokenize alone as inside the text (a special token that strips the
spaces beside it; a SentencePiece-style prefix space), where the encoder must notice and tokenize whole texts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from slime_server.gateway.chat_template import ChatRenderer
from slime_server.gateway.token_pieces import PIECES, PieceEncoder
from tests._sessions_helpers import TOOLS

WORDS = ("the fox jumps  over\n\n a lazy dog; Traceback: x == 1 != {} [] é ü 漢字 ✓ 🙂 \t tabs   spaces "
         "<|im_end|> <think> </think> <tool_call> {\"a\": 1}").split(" ")


def agent_conversation(turns: int, seed: int = 0) -> list[dict]:
    """A coding agent's conversation: tool calls, tool results with odd whitespace and unicode, and a user message
    that contains a special token's text literally (tokenized as that special token, whole or piecewise)."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    messages: list[dict] = [{"role": "system", "content": "You are a coding agent. " + text(30)},
                            {"role": "user", "content": "Fix it <|im_end|> now. " + text(80)}]
    for k in range(turns):
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "' + text(3) + '"}'}}
        messages += [{"role": "assistant", "content": text(20), "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{k}", "content": "\n " + text(150) + " \n"}]
    return messages


def misses() -> float:
    return PIECES.labels("miss")._value.get()


@pytest.mark.parametrize("model", ["tiny", "real"])
def test_piecewise_ids_equal_whole_text_ids(model: str, tiny_model_path: Path, request) -> None:
    """On both models' real tokenizers and chat templates, the ids of growing agent conversations equal the
    tokenizer's ids of the whole rendered text, and a turn tokenizes only the pieces it added."""
    path = tiny_model_path if model == "tiny" else request.getfixturevalue("real_model_path")
    renderer = ChatRenderer(path)
    assert renderer._pieces.exact  # the fast path is the one this test runs
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    seen: set[str] = set()
    for turns in (0, 1, 2, 3, 6, 12):
        text = renderer.render_text(agent_conversation(turns), TOOLS)
        pieces = {p for p in renderer._special_split_re.split(text)[::2] if p}  # the text between special tokens
        before = misses()
        ids = renderer.encode(text)
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert misses() - before == len(pieces - seen) > 0  # only what this turn added was tokenized
        seen |= pieces
    again = misses()
    assert renderer.encode(text) == ids and misses() == again  # nothing tokenized twice


def _with_stripping_special(tiny_model_path: Path) -> tuple[PreTrainedTokenizerFast, dict[str, int]]:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<|strip|>", lstrip=True, rstrip=True,
                                                                     special=True, normalized=False)]})
    specials = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    return tok, specials


def _prefix_space_tokenizer() -> tuple[PreTrainedTokenizerFast, dict[str, int]]:
    """A SentencePiece-style tokenizer (Llama 2, Mistral): the text, and only the text, starts with a prefix space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in ("hello", "world", "x", "a", "b", "y", "z"):
        vocab[w] = len(vocab)
        vocab["▁" + w] = len(vocab)
    raw = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix="##"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tok, {"<s>": 1, "</s>": 2}


@pytest.mark.parametrize("make", ["stripping_special", "prefix_space"])
def test_tokenizers_whose_pieces_differ_alone_are_tokenized_whole(make: str, tiny_model_path: Path) -> None:
    tok, specials = (_with_stripping_special(tiny_model_path) if make == "stripping_special"
                     else _prefix_space_tokenizer())
    special = next(s for s in specials if s not in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
    text = f"hello world {special} x a{special}b"
    enc = PieceEncoder(tok, specials)
    piecewise = enc._piecewise(text, enc.whole)
    assert piecewise != enc.whole(text)  # the case is real for this tokenizer
    assert not enc.exact  # the probe saw it
    assert enc.encode(text) == enc.whole(text) == tok.encode(text, add_special_tokens=False)


def test_the_cache_stays_within_its_bytes(tiny_model_path: Path) -> None:
    renderer = ChatRenderer(tiny_model_path)
    enc = PieceEncoder(renderer.tokenizer, renderer._pieces._ids, max_bytes=20_000)
    assert enc.exact
    text = renderer.render_text(agent_conversation(30, seed=1), TOOLS)
    assert len(text) > 20_000
    for _ in range(2):
        assert enc.encode(text) == enc.whole(text)
        assert 0 < enc.cached_bytes <= 20_000
