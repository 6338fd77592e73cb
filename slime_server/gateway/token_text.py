"""Text from token ids the way clients need it: never half a character, and each token's own bytes.

Why: a byte-level BPE token can end in the middle of a UTF-8 character (one CJK character or emoji
is often two or three tokens). Decoding ids that stop there gives U+FFFD for the missing part. SGLang's
detokenizer (``detokenizer_manager.py``) therefore holds such a tail back while a request streams and
emits it once the next token completes it; it does not do so for the final text, where a request cut by
``max_new_tokens`` ends in U+FFFD. The gateway applies the same rule to whatever engine it talks to:

- :func:`streamable` cuts a streamed snapshot before any trailing U+FFFD (it may be completed later);
- :func:`final_text` drops the one U+FFFD that stands for an incomplete (not invalid) byte tail of an
  answer that stopped without a stop token, so the answer never ends in a character nobody produced;
- :class:`TokenBytes` gives every token id its own bytes (OpenAI's ``logprobs[].bytes``), so the
  concatenated bytes of the answer's tokens are the UTF-8 of its text, partial characters included.

A U+FFFD stays where the model really produced invalid bytes (an incomplete character followed by a
byte that cannot continue it, or a stop token).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the printable character byte-level BPE uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kind(tokenizer: Any) -> str:
    """``byte_level`` (GPT-2/Qwen/Llama 3/SmolLM), ``byte_fallback`` (SentencePiece: Llama 2/Mistral), or ``other``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "other"
    try:  # the decoder's own JSON (the whole tokenizer's would be megabytes)
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    except (ValueError, AttributeError, TypeError):
        return "other"
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types:
        return "byte_fallback"
    return "other"


class TokenBytes:
    """Each token id's own bytes, read from the vocabulary (cached per id).

    Special and added tokens are the UTF-8 of their content. For a tokenizer whose decoder is neither
    byte-level nor byte-fallback, a token's bytes are those of its decoded text, which is exact for
    every token that decodes to whole characters.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        self._added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, bytes] = {}
        self._alphabet = _byte_level_alphabet()

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._compute(int(token_id))
        return got

    def join(self, ids: Sequence[int]) -> bytes:
        return b"".join(self(t) for t in ids)

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if self.kind == "byte_level":
            alphabet = self._alphabet
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
        elif self.kind == "byte_fallback":
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id]).encode()


def token_string(data: bytes) -> str:
    """OpenAI's ``logprobs[].token`` for a token's bytes: its text, or ``bytes:\\xNN..`` for a partial character."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def incomplete_utf8_tail(data: bytes) -> int:
    """Length of a trailing UTF-8 sequence that is valid so far but unfinished (0 when there is none)."""
    for back in range(1, min(3, len(data)) + 1):
        b = data[-back]
        if 0x80 <= b <= 0xBF:  # continuation byte: look further back for the lead byte
            continue
        need = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
        if need == 0 or back >= need:
            return 0
        seq = data[-back:]
        try:  # a valid prefix decodes with only the missing bytes reported, never an invalid byte
            seq.decode()
        except UnicodeDecodeError as e:
            return back if e.reason == "unexpected end of data" else 0
        return 0
    return 0


def streamable(text: str) -> str:
    """A snapshot of a text still being generated, cut before a trailing U+FFFD (SGLang's rule)."""
    return text.rstrip(REPLACEMENT)


def final_text(text: str, output_ids: Sequence[int], token_bytes: Callable[[int], bytes],
               stopped_by_token: bool) -> str:
    """The answer's text without the U+FFFD of an unfinished character that generation was cut in.

    ``stopped_by_token``: the last id is a stop token the text leaves out; a character left open before
    it is then invalid output of the model and keeps its U+FFFD.
    """
    if stopped_by_token or not text.endswith(REPLACEMENT):
        return text
    tail = b"".join(token_bytes(t) for t in output_ids[-4:])  # an open character spans at most 3 bytes
    return text[:-1] if incomplete_utf8_tail(tail) else text


def join_texts(first_text: str, first_ids: Sequence[int], more_text: str, more_ids: Sequence[int],
               token_bytes: Callable[[int], bytes]) -> str:
    """``first_text`` then ``more_text`` (decoded apart, e.g. an aborted request and its continuation),
    mended where one character was split between the two: the first shows its open tail as one U+FFFD,
    the second shows each byte that would have closed it as one U+FFFD of its own."""
    if not (first_text.endswith(REPLACEMENT) and more_text.startswith(REPLACEMENT)):
        return first_text + more_text
    head = b"".join(token_bytes(t) for t in first_ids[-4:])
    open_len = incomplete_utf8_tail(head)
    lead = b"".join(token_bytes(t) for t in more_ids[:4])
    closing = 0
    while closing < min(3, len(lead)) and 0x80 <= lead[closing] <= 0xBF:
        closing += 1
    if not open_len or not closing or not more_text.startswith(REPLACEMENT * closing):
        return first_text + more_text
    seam = (head[-open_len:] + lead[:closing]).decode("utf-8", "replace")
    return first_text[:-1] + seam + more_text[closing:]
