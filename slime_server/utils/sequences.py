"""Token-sequence helpers shared by the engine's prefix cache and the trainer's prefix tree."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Lists are compared a chunk at a time in C (chunks doubling from 64, then bisecting the chunk that differs):
    an agent's next turn shares ~all of its 100k-token prompt with the last one, and the element loop took ~5 ms
    per comparison on the engine's scheduler thread (the prefix cache compares on every prompt and every finish)."""
    n = min(len(a), len(b))
    if not (isinstance(a, list) and isinstance(b, list)):  # slices of other sequences may not compare as lists do
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i
    i, step = 0, 64
    while i < n:
        j = min(n, i + step)
        if a[i:j] != b[i:j]:
            break
        i, step = j, 2 * step
    else:
        return n
    lo, hi = i, j  # a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:  # a difference lies in a[lo:hi]
        lo += 1
    return lo
