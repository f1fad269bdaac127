"""The order competitors run in, round after round, in the interleaved benchmarks
(``bench`` and ``bench --e2e``)."""

from __future__ import annotations

__all__ = ["round_order"]


def round_order(names: list[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: a row of a Williams design over ``names``.

    What ran just before a call changes its time: a 0.1 ms call after torch's SDPA or after
    another small torch op measured 25-45% slower on Sapphire Rapids than after itself (the
    caches and worker threads the previous op left). A fixed order (or a rotated one, which
    keeps the neighbours) gives each competitor the same predecessor in every round. Williams'
    Latin square is balanced for the predecessor: over its rows (n of them for n names, 2n
    when n is odd) each competitor runs right after each other one equally often."""
    n = len(names)
    if n < 2:
        return list(names)
    first = [0]  # 0, 1, n-1, 2, n-2, ...
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + shift) % n for x in first] for shift in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [names[i] for i in rows[round_index % len(rows)]]
