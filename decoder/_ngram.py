"""Prompt-lookup drafting: propose what followed the last n-gram earlier in the sequence.

    NgramDrafter(max_ngram=3).propose([5, 6, 7, 9, 5, 6], k=3)  # -> [7, 9, 5]

Needs only token ids (no features): the cheapest subscriber of the loop. Drafts are
deterministic, so sampling verification uses the point-mass rule.
"""

from __future__ import annotations


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens; fewer (or none) when no earlier match exists."""
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = tokens[n_tok - n:]
            # most recent earlier occurrence wins: it is the likeliest continuation
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []

    def match_length(self, tokens: list[int]) -> int:
        """Length of the longest suffix n-gram seen earlier (0 if none): a cheap confidence signal."""
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), 0, -1):
            tail = tokens[n_tok - n:]
            if any(tokens[s:s + n] == tail for s in range(n_tok - n - 1, -1, -1)):
                return n
        return 0
