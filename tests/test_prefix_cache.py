"""The engine's prefix cache (``rollout/prefix_cache.py``): the longest shared prefix found by order, not by scan."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_server.rollout.prefix_cache import Donor, PrefixCache
from slime_server.utils.sequences import common_prefix


def kv_of(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer of K/V whose values are the token ids (so a returned buffer says whose it is)."""
    t = torch.tensor(ids, dtype=torch.float32)[None, :, None]
    return [(t.clone(), -t.clone())]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "match"]), st.integers(0, 10**6)), min_size=1, max_size=60))
def test_match_is_the_longest_prefix_of_any_entry(ops: list[tuple[str, int]]) -> None:
    """Random puts and matches over sequences that share prefixes of every length (a system prompt, sessions that
    extend their last turn, siblings): a match returns the longest common prefix over all entries (capped at
    len - 1, at least min_match), with K/V that holds exactly those tokens; the budget and the LRU hold."""
    cache = PrefixCache(max_tokens=400, min_match=4)
    system = [7, 7, 1, 2, 3]
    seen: list[list[int]] = []
    for op, seed in ops:
        rng = random.Random(seed)
        if seen and rng.random() < 0.6:  # extend or branch off something seen
            base = rng.choice(seen)
            ids = base[: rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        else:
            ids = system + [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        if op == "put":
            cache.put(ids, kv_of(ids))
            seen.append(ids)
        else:
            live = [e.ids[1:] for e in cache._entries.values()]  # past the namespace
            want = min(max((common_prefix(e, ids) for e in live), default=0), len(ids) - 1)
            kv, got, _ = cache.match(ids)
            if want < cache.min_match:
                assert (kv, got) == (None, 0)
            else:
                assert got == want
                assert kv[0][0][0, :got, 0].tolist() == ids[:got]
        assert cache.tokens == sum(e.size for e in cache._entries.values()) <= cache.max_tokens
        assert cache._sorted_ids == sorted(e.ids for e in cache._entries.values())


def test_a_match_never_crosses_namespaces() -> None:
    """K/V computed under one LoRA adapter load (its namespace) is never reused for another or for the base, even
    for the same tokens; within a namespace the longest prefix wins as before."""
    cache = PrefixCache(max_tokens=1000, min_match=4)
    ids = list(range(40))
    cache.put(ids, kv_of(ids), namespace=3)
    assert cache.match(ids + [1]) == (None, 0, None)
    assert cache.match(ids + [1], namespace=4) == (None, 0, None)
    kv, got, _ = cache.match(ids + [1], namespace=3)
    assert got == 40 and kv[0][0][0, :40, 0].tolist() == ids
    cache.put(ids[:30], kv_of(ids[:30]))  # the base's own entry: found for the base only
    assert cache.match(ids + [1])[1] == 30 and cache.match(ids + [1], namespace=3)[1] == 40


def test_a_sessions_next_turn_supersedes_its_last() -> None:
    cache = PrefixCache(max_tokens=10_000)
    turn1 = list(range(100, 140))
    cache.put(turn1, kv_of(turn1))
    cache.put(list(range(100, 120)) + [5] * 30, kv_of(list(range(100, 120)) + [5] * 30))  # another session's branch
    turn2 = turn1 + list(range(200, 230))
    cache.put(turn2, kv_of(turn2))
    assert sorted(e.ids[1:] for e in cache._entries.values()) == sorted([turn2, list(range(100, 120)) + [5] * 30])
    kv, got, _ = cache.match(turn2 + [1, 2, 3])
    assert got == len(turn2) and kv[0][0][0, :, 0].tolist() == turn2
    cache.clear()
    assert (len(cache), cache.tokens, cache.match(turn2)) == (0, 0, (None, 0, None))


def test_a_donor_lends_its_buffers_where_it_shares_more_than_the_cache() -> None:
    """A prompt prefilled just before in the same step (``Donor``: not finished, so not in the cache) is reused
    where it shares a longer prefix than any entry, at least ``min_match`` tokens, in the same namespace, and never
    past the asking prompt's last token; otherwise the cache's entry (or nothing) stands."""
    cache = PrefixCache(max_tokens=1000, min_match=4)
    ids = list(range(50))
    cache.put(ids[:20], kv_of(ids[:20]))
    donor = Donor([0, *ids[:35]], kv_of(ids[:35]))
    kv, got, _ = cache.match(ids, donor=donor)
    assert got == 35 and kv is donor.kv
    assert cache.match(ids[:30], donor=donor)[1] == 29  # the last prompt token is always computed
    assert cache.match(ids, donor=Donor([0, *ids[:10]], kv_of(ids[:10])))[1] == 20  # the cache shares more
    assert cache.match(ids, namespace=2, donor=donor) == (None, 0, None)  # another adapter's K/V
    fresh = PrefixCache(max_tokens=1000, min_match=4)
    assert fresh.match(ids, donor=Donor([0, *ids[:3]], kv_of(ids[:3]))) == (None, 0, None)  # under min_match
    assert fresh.match(ids, donor=donor)[1] == 35 and (fresh.hits, fresh.reused_tokens) == (1, 35)
