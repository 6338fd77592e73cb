"""Tokenizing a conversation piece by piece, each piece once, instead of the whole text on every turn.

An agent re-sends its whole conversation with every request, and the gateway renders it and used to tokenize the
whole text again: at 72k tokens the tokenizer took ~250 ms of the request (holding the GIL), and more every turn.
Special tokens are split off before BPE (the invariant ``ChatRenderer.suffix_text`` relies on too), so a rendered
conversation's ids are the ids of the text between its special tokens, each piece tokenized alone, with the special
tokens' own ids between them; and those pieces (the system prompt, each message, each tool result) are the same
from one turn to the next. So pieces are cached (least recently used, bounded in bytes) and a turn tokenizes only
its new ones.

Checked per tokenizer, not assumed: where a special token strips the whitespace beside it (``lstrip``/``rstrip``)
or a normalizer or pre-tokenizer treats the start of a text specially (SentencePiece's prefix space), a piece alone
tokenizes differently; ``PieceEncoder`` probes the tokenizer when it is built and, where piecewise and whole
disagree on any probe, tokenizes whole texts as before (``exact`` is False).
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter

PIECES = Counter("slime_gateway_token_pieces_total", "text pieces between special tokens the gateway tokenized "
                 "(miss) or found already tokenized (hit)", ["result"])
_HITS, _MISSES = PIECES.labels("hit"), PIECES.labels("miss")

_PROBE_TEXTS = ("a {s} b", "a{s}b", "\n{s}\n", " {s} ", "{s} x", "x {s}", "{s}{s}", "  {s}\n\n  y z", "é {s}ü\t")
_PROBE_PLAIN = ("hello world", " leading space", "\n\nnew lines\n", "ünïcödé ✓ 漢字", "x")


class PieceEncoder:
    """``encode(text)``: the tokenizer's ids of ``text`` (no special tokens added), computed per piece between special
    tokens and cached; whole-text tokenization where the probe found the two differ."""

    def __init__(self, tokenizer: Any, specials: Mapping[str, int], *, max_bytes: int = 64 * 2**20,
                 probes: Iterable[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids = dict(specials)
        alternatives = special_alternatives(self._ids)
        self._split = re.compile(f"({alternatives})") if alternatives else None
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.exact = self._split is not None and self._agrees(probes)

    def whole(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        if not self.exact:
            return self.whole(text)
        found = [0, 0]  # pieces cached, pieces tokenized: counted once per text, not per piece

        def piece(p: str) -> Sequence[int]:
            ids = self._cached(p)
            found[ids is None] += 1
            return self._tokenized(p) if ids is None else ids

        out = self._piecewise(text, piece)
        _HITS.inc(found[0])
        _MISSES.inc(found[1])
        return out

    def _piecewise(self, text: str, tokenize: Callable[[str], Sequence[int]]) -> list[int]:
        assert self._split is not None
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):  # text, special, text, special, ..., text
            if i % 2:
                out.append(self._ids[piece])
            elif piece:
                out.extend(tokenize(piece))
        return out

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def _cached(self, piece: str) -> array | None:
        with self._lock:
            ids = self._cache.get(piece)
            if ids is not None:
                self._cache.move_to_end(piece)
            return ids

    def _tokenized(self, piece: str) -> array:
        ids = array("i", self.whole(piece))  # token ids fit 32 bits
        size = _cost(piece, ids)
        if size > self.max_bytes:  # larger than the whole cache: not kept
            return ids
        with self._lock:
            if piece not in self._cache:  # another thread may have tokenized it meanwhile
                self._cache[piece] = ids
                self._bytes += size
                while self._bytes > self.max_bytes:
                    old_piece, old_ids = self._cache.popitem(last=False)
                    self._bytes -= _cost(old_piece, old_ids)
        return ids

    def _agrees(self, probes: Iterable[str]) -> bool:
        """Whether piecewise tokenization equals whole-text tokenization on every probe: each special token in
        the contexts a template puts it in (beside spaces, new lines, text, another special token), plain texts,
        and ``probes`` (e.g. a conversation rendered by the model's own template)."""
        texts = [p.format(s=s) for s in self._ids for p in _PROBE_TEXTS] + list(_PROBE_PLAIN) + list(probes)
        return all(self._piecewise(t, self.whole) == self.whole(t) for t in texts)


def special_alternatives(specials: Iterable[str]) -> str:
    """A regex alternation of the special tokens, longest first so that it never matches a special token's prefix."""
    return "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))


def _cost(piece: str, ids: array) -> int:
    """Bytes a cached piece holds: its text and its ids (4 bytes each), plus the entry's overhead, about."""
    return sys.getsizeof(piece) + ids.itemsize * len(ids) + 200
