"""Prefix reuse in the CPU engine: SGLang's radix-cache idea at CPU scale.

An agent's next turn is its last turn's prompt and answer plus a little more, so the engine keeps
the K/V of finished generations (compact copies) and a new prompt that starts with one
of them computes only its new tokens. Prompts that arrive together share too (``Donor``): a group of
episodes starting at once, the samples of one ``n > 1`` request, a burst after a weight update emptied the
cache all share a system prompt that no finished generation holds yet; the engine prefills them in the
lexicographic order of their tokens and each may reuse the buffers of the one prefilled just before it. Entries are whole token sequences, matched by longest common
prefix, evicted least-recently-used within a token budget. K/V depends on the weights: the engine
clears this cache on every weight update and on ``/flush_cache``.

The entries' token lists are also kept in lexicographic order, because the entry sharing the longest prefix
with a prompt is the prompt's neighbour in that order (for a <= b <= c, lcp(a, c) = min(lcp(a, b), lcp(b, c))):
a match is a binary search and two comparisons, not one comparison per entry. Comparing every entry cost ~10 ms
per prompt and as much per finish with 3,000 entries sharing a system prompt, on the scheduler thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slime_server.rollout.engine_sequence import KV
from slime_server.utils.sequences import common_prefix

SUPERSEDE_SCAN = 8  # entries before a new one checked for being its prefix (the same session's last turn is one)


@dataclass
class _Entry:
    ids: list[int]  # [namespace, *tokens]: the tokens whose K/V the buffers hold (positions 0 .. len - 2)
    kv: KV
    routes: torch.Tensor | None = None  # an MoE model's routed experts of those positions (engine_routes.py)

    @property
    def size(self) -> int:
        """Tokens of buffer held (capacity, not length: what the memory costs)."""
        return int(self.kv[0][0].shape[1]) if self.kv else 0


class Reuse(NamedTuple):
    """A match: the entry's K/V buffers, how many leading tokens of the prompt they hold, and their routes (MoE)."""

    kv: KV | None
    tokens: int
    routes: torch.Tensor | None = None


NO_REUSE = Reuse(None, 0)


class Donor(NamedTuple):
    """A sequence prefilled just before, in the same step: its buffers, not copied (it is not finished)."""

    ids: list[int]  # [namespace, *tokens] whose K/V its buffers hold
    kv: KV
    routes: torch.Tensor | None = None


class PrefixCache:
    def __init__(self, max_tokens: int, min_match: int = 16) -> None:
        self.max_tokens = max_tokens
        self.min_match = min_match
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._sorted_ids: list[list[int]] = []  # every entry's ids, in lexicographic order (unique: see put)
        self._sorted_keys: list[int] = []  # the entry key at the same position
        self._tokens = 0
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ids: list[int], kv: KV, namespace: int = 0, routes: torch.Tensor | None = None) -> None:
        """Keep a compact copy of ``kv``'s first ``len(ids)`` positions (per layer [heads, >= len, hd]); a copy,
        since ``kv`` may be a row of the engine's batch buffer. An entry with the same ids, and entries just
        before it in order that are a prefix of it (the session's earlier turns), are superseded.
        ``namespace``: what else the K/V depends on (a LoRA adapter's load: 0 for the base); a match is only
        ever within one namespace. ``routes``: an MoE model's routed experts of the same positions, kept with them."""
        if len(ids) < self.min_match or not kv or kv[0][0].shape[1] < len(ids):
            return
        n = len(ids)
        entry = _Entry([namespace, *ids], [(k[:, :n].clone(), v[:, :n].clone()) for k, v in kv],
                       None if routes is None else routes[:n].clone())
        if entry.size > self.max_tokens:
            return
        i = bisect_left(self._sorted_ids, entry.ids)
        if i < len(self._sorted_ids) and self._sorted_ids[i] == entry.ids:
            self._remove(self._sorted_keys[i])
        for j in range(i - 1, max(-1, i - 1 - SUPERSEDE_SCAN), -1):  # a prefix of ids sorts before it
            if common_prefix(self._sorted_ids[j], entry.ids) == len(self._sorted_ids[j]):
                self._remove(self._sorted_keys[j])
        while self._entries and self._tokens + entry.size > self.max_tokens:
            self._remove(next(iter(self._entries)))
        key = self._next
        self._next += 1
        self._entries[key] = entry
        self._tokens += entry.size
        i = bisect_left(self._sorted_ids, entry.ids)
        self._sorted_ids.insert(i, entry.ids)
        self._sorted_keys.insert(i, key)

    def match(self, ids: list[int], namespace: int = 0, donor: Donor | None = None) -> Reuse:
        """The buffers of the entry (of ``namespace``) sharing the longest prefix with ``ids`` and that length (at
        most ``len(ids) - 1``: the last prompt token is always computed, its logits are needed); ``donor``'s
        where it shares more. Why only one donor: prompts prefilled in lexicographic order, the one sharing the
        longest prefix with a prompt among those before it is the one just before it."""
        n = len(ids)
        ids = [namespace, *ids]  # ordered against the entries' keys, namespace first
        i = bisect_left(self._sorted_ids, ids)
        best_key, best = None, 0
        for j in (i - 1, i):  # the longest common prefix is with a neighbour in lexicographic order
            if 0 <= j < len(self._sorted_ids):
                m = common_prefix(self._sorted_ids[j], ids)
                if m > best:
                    best_key, best = self._sorted_keys[j], m
        best = min(best - 1, n - 1)  # tokens past the namespace; none when the namespace differs (best 0)
        if donor is not None:
            lent = min(common_prefix(donor.ids, ids) - 1, n - 1)
            if lent > best and lent >= self.min_match:
                self.hits += 1
                self.reused_tokens += lent
                return Reuse(donor.kv, lent, donor.routes)
        if best_key is None or best < self.min_match:
            return NO_REUSE
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        entry = self._entries[best_key]
        return Reuse(entry.kv, best, entry.routes)

    def clear(self) -> None:
        self._entries.clear()
        self._sorted_ids.clear()
        self._sorted_keys.clear()
        self._tokens = 0

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._tokens -= entry.size
        i = bisect_left(self._sorted_ids, entry.ids)
        while self._sorted_keys[i] != key:  # ids are unique, so this is i itself; kept safe all the same
            i += 1
        del self._sorted_ids[i]
        del self._sorted_keys[i]
