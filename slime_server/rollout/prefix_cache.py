"""Prefix reuse in the CPU engine: SGLang's radix-cache idea at CPU scale.

An agent's next turn is its last turn's prompt and answer plus a little more, so the engine keeps
the K/V of finished generations (compact copies) and a new prompt that starts with one
of them computes only its new tokens. Entries are whole token sequences, matched by longest common
prefix, evicted least-recently-used within a token budget. K/V depends on the weights: the engine
clears this cache on every weight update and on ``/flush_cache``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from slime_server.rollout.engine_sequence import KV
from slime_server.utils.sequences import common_prefix


@dataclass
class _Entry:
    ids: list[int]  # the tokens whose K/V the buffers hold (positions 0 .. len(ids)-1)
    kv: KV

    @property
    def size(self) -> int:
        """Tokens of buffer held (capacity, not length: what the memory costs)."""
        return int(self.kv[0][0].shape[1]) if self.kv else 0


class PrefixCache:
    def __init__(self, max_tokens: int, min_match: int = 16) -> None:
        self.max_tokens = max_tokens
        self.min_match = min_match
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    @property
    def tokens(self) -> int:
        return sum(e.size for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ids: list[int], kv: KV) -> None:
        """Keep a compact copy of ``kv``'s first ``len(ids)`` positions (per layer [heads, >= len, hd]); a copy,
        since ``kv`` may be a row of the engine's batch buffer."""
        if len(ids) < self.min_match or not kv or kv[0][0].shape[1] < len(ids):
            return
        n = len(ids)
        entry = _Entry(list(ids), [(k[:, :n].clone(), v[:, :n].clone()) for k, v in kv])
        if entry.size > self.max_tokens:
            return
        for key in [k for k, e in self._entries.items() if common_prefix(e.ids, entry.ids) == len(e.ids)]:
            del self._entries[key]  # a shorter prefix of this sequence: superseded
        while self._entries and self.tokens + entry.size > self.max_tokens:
            self._entries.popitem(last=False)
        self._entries[self._next] = entry
        self._next += 1

    def match(self, ids: list[int]) -> tuple[KV | None, int]:
        """The buffers of the entry sharing the longest prefix with ``ids`` and that length (at most
        ``len(ids) - 1``: the last prompt token is always computed, its logits are needed)."""
        best_key, best = None, 0
        for key, e in self._entries.items():
            m = common_prefix(e.ids, ids)
            if m > best:
                best_key, best = key, m
        best = min(best, len(ids) - 1)
        if best_key is None or best < self.min_match:
            return None, 0
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return self._entries[best_key].kv, best

    def clear(self) -> None:
        self._entries.clear()
