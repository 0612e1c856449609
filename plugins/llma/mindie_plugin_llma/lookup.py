"""N-gram lookup over a sequence's own tokens: where did its last tokens occur before, and what followed?

:class:`NgramIndex` keeps, for one sequence, the last position at which each n-gram (of the sizes
asked) ended, updated incrementally as tokens are appended, so a lookup costs a few dictionary
probes per step whatever the sequence's length.
"""

from __future__ import annotations


class NgramIndex:
    """The latest end position of every n-gram of sizes ``min_n..max_n`` in a growing token list."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix n-gram of
        ``tokens`` found (longest sizes first); empty when none occurred before."""
        end = len(tokens) - 1  # the suffix n-grams end here; index the ones ending before it
        if end < self.indexed:  # the list shrank (never in the engine): start over
            self.last_end.clear()
            self.indexed = 0
        last_end = self.last_end
        for e in range(self.indexed, end):
            for n in self.sizes:
                if e + 1 >= n:
                    last_end[tuple(tokens[e + 1 - n : e + 1])] = e
        self.indexed = max(self.indexed, end)
        for n in self.sizes:
            if end + 1 < n:
                continue
            e = last_end.get(tuple(tokens[end + 1 - n : end + 1]))
            if e is not None:
                return tokens[e + 1 : min(e + 1 + k, end + 1)]
        return []
