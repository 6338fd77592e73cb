"""Token ids -> client text (slime_server/gateway/token_text.py), fed random token sequences directly.

Random ids from a byte-level vocabulary split characters anywhere and produce invalid byte runs, so
these properties cover what a model can emit: streamed deltas equal the final text, a U+FFFD appears
only for bytes that are really invalid, the tokens' bytes are the text's UTF-8, and two halves decoded
apart (an aborted request and its continuation) join into the text of the whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from slime_server.gateway.token_text import (
    REPLACEMENT,
    TokenBytes,
    _byte_level_alphabet,
    final_text,
    incomplete_utf8_tail,
    join_texts,
    streamable,
    token_string,
)

CJK = "北京是中国的首都。東京は日本の首都です。😀🎉 Ça va très bien, merci! Überall 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tiny_model_path: Path):
    path = tiny_model_path if request.param == "tiny" else request.getfixturevalue("real_model_path")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def vocab(tokenizer) -> list[int]:
    specials = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in specials]


_TB: dict[int, TokenBytes] = {}


def _token_bytes(tokenizer) -> TokenBytes:
    """One table per tokenizer: reading the decoder type parses the whole tokenizer JSON."""
    if id(tokenizer) not in _TB:
        _TB[id(tokenizer)] = TokenBytes(tokenizer)
    return _TB[id(tokenizer)]


def _stream(tok, ids: list[int], token_bytes: TokenBytes) -> tuple[str, str]:
    """(concatenated deltas of a stream that shows a snapshot after every token, final text)."""
    emitted = ""
    for k in range(1, len(ids)):
        snap = streamable(tok.decode(ids[:k]))
        assert snap.startswith(emitted), (emitted, snap)  # a held-back tail never changes what was sent
        emitted = snap
    final = final_text(tok.decode(ids), ids, token_bytes, stopped_by_token=False)
    assert final.startswith(emitted)
    return emitted + final[len(emitted):], final


def _expected(data: bytes) -> str:
    """The text of ``data``: invalid bytes as U+FFFD, an unfinished last character dropped."""
    return data[: len(data) - incomplete_utf8_tail(data)].decode("utf-8", "replace")


def test_incomplete_tail_tells_unfinished_from_invalid():
    e = "中".encode()  # e4 b8 ad
    assert [incomplete_utf8_tail(e[:k]) for k in range(4)] == [0, 1, 2, 0]
    assert incomplete_utf8_tail("😀".encode()[:3]) == 3
    assert incomplete_utf8_tail(b"a\xe4\xb8a") == 0  # closed by a byte that cannot continue it: invalid
    assert incomplete_utf8_tail(b"\xe0\x80") == 0  # an overlong prefix is invalid, not unfinished
    assert incomplete_utf8_tail(b"\xbf") == 0 and incomplete_utf8_tail(b"\xff") == 0


def test_token_string_names_partial_bytes_as_openai_does():
    assert token_string("北".encode()) == "北"
    assert token_string(b"\xe4\xb8") == "bytes:\\xe4\\xb8"


def test_text_in_many_scripts_streams_whole_characters(tokenizer):
    ids = tokenizer.encode(CJK, add_special_tokens=False)
    tb = TokenBytes(tokenizer)
    assert tb.kind == "byte_level"
    assert tb.join(ids) == CJK.encode()
    streamed, final = _stream(tokenizer, ids, tb)
    assert streamed == final == CJK
    for k in range(1, len(ids)):  # cut anywhere (max_tokens): whole characters only, no U+FFFD
        cut = final_text(tokenizer.decode(ids[:k]), ids[:k], tb, stopped_by_token=False)
        assert REPLACEMENT not in cut and CJK.startswith(cut)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_sequences(tokenizer, vocab, data):
    ids = data.draw(st.lists(st.sampled_from(vocab), min_size=1, max_size=24))
    tb = _token_bytes(tokenizer)
    raw = tb.join(ids)
    assert tokenizer.decode(ids) == raw.decode("utf-8", "replace")  # the ids' bytes are the decoder's bytes
    streamed, final = _stream(tokenizer, ids, tb)
    assert streamed == final == _expected(raw)
    split = data.draw(st.integers(1, len(ids)))
    joined = join_texts(tokenizer.decode(ids[:split]), ids[:split], tokenizer.decode(ids[split:]), ids[split:], tb)
    assert joined == tokenizer.decode(ids)


def test_stop_token_after_an_open_character_keeps_its_replacement(tokenizer):
    tb = TokenBytes(tokenizer)
    by_byte = {v: k for k, v in _byte_level_alphabet().items()}  # every byte is a token of a byte-level BPE
    ids = [tokenizer.convert_tokens_to_ids(by_byte[b]) for b in "中".encode()[:2]]
    text = tokenizer.decode(ids)
    assert text.endswith(REPLACEMENT)
    assert final_text(text, ids, tb, stopped_by_token=False) == text[:-1]  # cut by max_tokens: dropped
    assert final_text(text, [*ids, tokenizer.eos_token_id], tb, stopped_by_token=True) == text  # invalid: kept
