"""``utils.sequences.common_prefix``: chunked comparison in C for lists, equal to the element-by-element rule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slime_server.utils.sequences import common_prefix


def element_by_element(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@settings(max_examples=400, deadline=None)
@given(shared=st.lists(st.integers(0, 3), max_size=3000), a_tail=st.lists(st.integers(0, 3), max_size=200),
       b_tail=st.lists(st.integers(0, 3), max_size=200))
def test_common_prefix_equals_the_element_rule(shared: list[int], a_tail: list[int], b_tail: list[int]) -> None:
    """Shared prefixes of every length around the chunk edges (64, 128, 192, ...), tails from a small alphabet so
    that they often agree a while longer; both orders; tuples (the element rule) and lists agree."""
    a, b = shared + a_tail, shared + b_tail
    want = element_by_element(a, b)
    assert common_prefix(a, b) == common_prefix(b, a) == common_prefix(tuple(a), b) == want
    assert common_prefix(a, a) == len(a) and common_prefix(a, []) == 0


def test_long_prefixes_at_chunk_edges() -> None:
    base = list(range(70_000))
    for k in (0, 1, 63, 64, 65, 191, 192, 193, 4095, 4096, 69_999):
        other = base[:k] + [-1] + base[k + 1:]
        assert common_prefix(base, other) == k
    assert common_prefix(base, base[:50_000]) == 50_000
