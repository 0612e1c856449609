"""N-gram lookup over a sequence's own tokens: where did its last tokens occur before, and what followed?

:class:`NgramIndex` keeps, for one sequence, every position at which each n-gram (of the sizes asked) ended,
updated incrementally as tokens are appended, so a lookup costs a few dictionary probes and one binary search
per step whatever the sequence's length.

Which occurrence to copy from: text that repeats its input (a code edit, a summary quoting its document) walks
through the source in order. After a run of accepted drafts the index remembers where in the source the copy
had reached (the *cursor*); the next lookup takes the first occurrence at or after the cursor, so a copy that
diverged for a token or two (a renamed identifier) picks up where it left off in the source, not at the latest
place its last tokens happened to occur (often the instruction that named the new identifier). Without a cursor,
or with no occurrence after it, the latest occurrence wins.
"""

from __future__ import annotations

from bisect import bisect_left


class NgramIndex:
    """Every end position of every n-gram of sizes ``min_n..max_n`` in a growing token list, and the copy cursor."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending before this position are in the index
        self.cursor: int | None = None  # where the last accepted copy had reached in the source
        self.source: int | None = None  # where the last proposal was copied from

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix n-gram of ``tokens`` found
        (longest sizes first): the first occurrence at or after the cursor, else the latest; empty when none
        occurred before."""
        end = len(tokens) - 1  # the suffix n-grams end here; index the ones ending before it
        if end < self.indexed:  # the list shrank (never in the engine): start over
            self.ends.clear()
            self.indexed = 0
            self.cursor = None
        ends = self.ends
        for e in range(self.indexed, end):
            for n in self.sizes:
                if e + 1 >= n:
                    ends.setdefault(tuple(tokens[e + 1 - n : e + 1]), []).append(e)
        self.indexed = max(self.indexed, end)
        self.source = None
        for n in self.sizes:
            if end + 1 < n:
                continue
            found = ends.get(tuple(tokens[end + 1 - n : end + 1]))
            if not found:
                continue
            e = found[-1]
            if self.cursor is not None:
                i = bisect_left(found, self.cursor - 1)  # ends are appended in increasing order
                if i < len(found):
                    e = found[i]
            self.source = e + 1
            return tokens[e + 1 : min(e + 1 + k, end + 1)]
        return []

    def accepted(self, count: int) -> None:
        """``count`` of the last proposal's tokens were accepted: the copy reached that far in the source."""
        if self.source is not None:
            self.cursor = self.source + count
