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

How many to copy: a match of one or two tokens is often chance (a common word, a bracket), and every draft
row costs compute even when the step is bound by reading the weights. :attr:`NgramIndex.match` says how many
tokens agree at the chosen occurrence (the n-gram and any agreeing tokens before it, counted up to one past
``short_match``); a match of at most ``short_match`` tokens proposes at most ``short_drafts``.
"""

from __future__ import annotations

from bisect import bisect_left


class NgramIndex:
    """Every end position of every n-gram of sizes ``min_n..max_n`` in a growing token list, and the copy cursor."""

    def __init__(self, min_n: int, max_n: int, short_match: int = 0, short_drafts: int = 1) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self.short_match = short_match  # matches of at most this many tokens propose at most short_drafts
        self.short_drafts = short_drafts
        self.match = 0  # tokens that agree at the last proposal's occurrence (counted up to short_match + 1)
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending before this position are in the index
        self.cursor: int | None = None  # where the last accepted copy had reached in the source
        self.source: int | None = None  # where the last proposal was copied from

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix n-gram of ``tokens`` found
        (longest sizes first): the first occurrence at or after the cursor, else the latest; empty when none
        occurred before. At most ``short_drafts`` when the match is ``short_match`` tokens or shorter."""
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
            agree = n
            while agree <= self.short_match and e - agree >= 0 and tokens[e - agree] == tokens[end - agree]:
                agree += 1
            self.match = agree
            if agree <= self.short_match:
                k = min(k, self.short_drafts)
            return tokens[e + 1 : min(e + 1 + k, end + 1)]
        return []

    def accepted(self, count: int) -> None:
        """``count`` of the last proposal's tokens were accepted: the copy reached that far in the source."""
        if self.source is not None:
            self.cursor = self.source + count
