"""Prompt-lookup drafting: propose what followed the last n-gram earlier in the sequence.

    NgramDrafter(max_ngram=3).propose([5, 6, 7, 9, 5, 6], k=3)  # -> [7, 9, 5]

    index = NgramDrafter().index(prompt_ids)      # incremental, one per batch row
    index.extend(new_ids)
    drafts, match = index.propose(k)              # match = suffix-match length (0: nothing)
    others = index.alternatives(k)                # what followed other occurrences (n-gram trees)

Needs only token ids (no features): the cheapest subscriber of the loop. Drafts are
deterministic, so sampling verification uses the point-mass rule. The loop keeps one
`NgramIndex` per row: a dict from each n-gram to the position after its latest
occurrence, updated as tokens are committed, so a proposal is O(max_ngram) instead of a
scan over the whole sequence. It also keeps the few occurrences before the latest one:
what followed them are the alternatives a batch-1 round verifies next to the proposal in
one tree (`_ngram_tree.py`).
"""

from __future__ import annotations


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens; fewer (or none) when no earlier match exists."""
        idx = self.index(tokens)
        return idx.propose(k)[0]

    def match_length(self, tokens: list[int]) -> int:
        """Length of the longest suffix n-gram seen earlier (0 if none): a cheap confidence signal."""
        return NgramIndex(tokens, self.max_ngram, 1).propose(1)[1]

    def index(self, tokens: list[int], prompt_len: int | None = None) -> NgramIndex:
        return NgramIndex(tokens, self.max_ngram, self.min_ngram, prompt_len)


class NgramIndex:
    """Latest occurrence of every 1..max_ngram-gram of one growing sequence.

    `propose(k)` returns (drafts, match length): the tokens that followed the most recent
    earlier occurrence of the longest suffix n-gram. `overlap` is the share of generated
    tokens whose trigram (or shorter, at the start) already occurs in the prompt: text that
    copies its prompt is where prompt lookup pays.
    """

    KEEP = 4  # earlier occurrences kept per n-gram besides the latest

    def __init__(self, tokens: list[int], max_ngram: int = 3, min_ngram: int = 1,
                 prompt_len: int | None = None) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.toks: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its latest occurrence
        self.before: dict[tuple[int, ...], list[int]] = {}  # ... and after up to KEEP earlier ones, oldest first
        self.prompt_len = len(tokens) if prompt_len is None else prompt_len
        self.in_prompt: set[tuple[int, ...]] = set()
        self.copied = 0
        self.generated = 0
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        toks, last, before, top, keep = self.toks, self.last, self.before, self.max_ngram, self.KEEP
        for t in new:
            # n-grams ending at the current last token get their follower now: only completed
            # occurrences go into the index, so the suffix never matches itself.
            end = len(toks)
            for n in range(1, min(top, end) + 1):
                gram = tuple(toks[end - n:end])
                old = last.get(gram)
                if old is not None:
                    seen = before.setdefault(gram, [])
                    seen.append(old)
                    if len(seen) > keep:
                        del seen[0]
                last[gram] = end
            toks.append(t)
            if end < self.prompt_len:
                for n in range(1, min(top, end + 1) + 1):
                    self.in_prompt.add(tuple(toks[end + 1 - n:end + 1]))
            else:
                self.generated += 1
                gram = tuple(toks[max(0, end + 1 - top):end + 1])
                self.copied += gram in self.in_prompt

    @property
    def overlap(self) -> float:
        return self.copied / self.generated if self.generated else 0.0

    def propose(self, k: int) -> tuple[list[int], int]:
        toks, n_tok = self.toks, len(self.toks)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            at = self.last.get(tuple(toks[n_tok - n:]))
            if at is not None:
                return toks[at:at + k], n
        return [], 0

    def alternatives(self, k: int, most: int = 3) -> list[tuple[list[int], int]]:
        """Up to `most` other (continuation, match length) pairs, each different from `propose(k)`'s and from
        one another: earlier occurrences of the longest matching suffix first (newest first), then of shorter
        suffixes."""
        toks, n_tok = self.toks, len(self.toks)
        out: list[tuple[list[int], int]] = []
        seen: set[tuple[int, ...]] = set()
        first = True
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            gram = tuple(toks[n_tok - n:])
            at = self.last.get(gram)
            if at is None:
                continue
            for pos in [at, *reversed(self.before.get(gram, ()))]:
                cont = toks[pos:pos + k]
                key = tuple(cont)
                if not cont or key in seen:
                    continue
                seen.add(key)
                if first:  # propose(k)'s own continuation
                    first = False
                    continue
                out.append((cont, n))
                if len(out) >= most:
                    return out
        return out
