"""Which path whole calls take, learned from the calls themselves: every drafter ("spec"), n-gram alone, or plain
decoding, per (batch, greedy or sampled, drafters).

    paths = PathChoice()
    path = paths.pick(key, PATHS)                  # "spec" or "plain" (NGRAM_PATHS adds "ngram")
    paths.observe(key, path, tokens_per_s, tokens)

Kept by the `CostModel` (`cost.paths`), so every decoder sharing a cost model shares what its calls learned.
"""

from __future__ import annotations

from collections import deque

PATHS = ("spec", "plain")  # every drafter the decoder has, or none (the target's own decoding)
NGRAM_PATHS = ("spec", "ngram", "plain")  # sampled batch-1 calls with a model drafter and n-gram: "ngram" alone



class PathChoice:
    """Whole calls, per (batch, mode, drafter): speculative rounds or the target's own `generate`, whichever took
    fewer seconds per token over its last WINDOW calls (their seconds over their tokens: what a run of calls
    waits for; a short call, whose rate is mostly its prefill and first-call costs, weighs what its tokens do).
    The other path is measured again after `gap` calls; each time it loses again the gap doubles (up to
    MAX_GAP), so a path that loses by a steady margin costs less and less to keep an eye on.

    A plain round of the speculative loop costs more than a step of `generate` (inputs, verify, per-row
    commit and accounting in Python): where drafting does not pay, the scheduler's plain rounds are slower
    than `generate`. Handing such calls over is how they stop losing; the comparison is of whole calls
    because that is what the user waits for. One call's rate depends on its prompt (drafts are accepted more
    on some), so a single unlucky call must not flip the choice: the window averages over prompts, where an
    earlier rule (the last two calls, re-tried every 8th) lost gains to calls handed over after one bad prompt.

    The first calls need the same care. A fresh decoder's first call pays the drafter's warm-up and learns its
    calibration from nothing, and per-call speedups spread widely over one set of prompts. So the speculative
    path keeps the calls until it has seen MIN_SPEC prompts (a call at batch b is b of them), unless it lost
    by more than CLEAR at once over CLEAR_TOKENS tokens or more (drafting does lose that clearly, at batch 8
    or when sampling). Counting prompts, not calls: a batch-8 call already averages over 8 prompts, and
    counting calls kept the speculative path through the first calls of a batch-8 benchmark where drafting
    lost. Weighing calls by their tokens: a short call (a warm-up, mostly its prefill) weighed as much as a
    long one under the earlier rule, which then handed nearly every later call to `generate` where drafting paid.

    A sampled batch-1 call of a decoder with a model drafter and n-gram lookup has a third path, "ngram": the
    loop with n-gram drafts alone, probes off (`SpeculativeDecoder._paths`). Each path is measured once, in order, then
    the best keeps the calls and the others are re-measured in turn. When sampling, n-gram alone beat the
    per-round choice between the model drafter and n-gram at about the same acceptance: the model drafter's
    steps and the probes' capture cost time every round, which the per-round rule, judging the model drafter's
    drafts by its own confidence, did not see to lose.

    (measured: docs/design.md, 'Decoder: measurements behind the code')"""

    WINDOW = 8
    FIRST_GAP, MAX_GAP = 8, 64
    MIN_SPEC = 3  # prompts the speculative path is measured on before it may lose by a small margin
    CLEAR = 1.15  # seconds per token against plain's that lose at once...
    # ...once the speculative path has decoded this many tokens. A fresh decoder's short first call (a warm-up,
    # a smoke test: its prefill, probes on, little to draft from yet) loses "clearly" and would hand the next
    # calls to `generate` where drafting pays (measured: docs/design.md, 'Decoder: measurements behind the code').
    CLEAR_TOKENS = 64

    def __init__(self) -> None:
        self.spt: dict[tuple, dict[str, deque[tuple[float, int]]]] = {}  # (seconds, tokens) of recent calls
        self.gap: dict[tuple, int] = {}
        self.since: dict[tuple, int] = {}  # calls since another path was last measured
        self.trying: dict[tuple, str] = {}  # the path a call is re-measuring
        self.turn: dict[tuple, int] = {}  # which of the other paths the next re-measurement tries

    def best(self, key: tuple) -> str | None:
        """The path with the fewest seconds per token, once "spec" and "plain" were measured (None before). A
        drafting path measured on fewer than MIN_SPEC prompts loses only by more than CLEAR, and not at all
        before CLEAR_TOKENS tokens. Ties go to the first path (speculative first)."""
        obs = self.spt.get(key)
        if not obs or not obs.get("spec") or not obs.get("plain"):
            return None
        rate = {}
        for path, window in obs.items():
            if not window:
                continue
            spt = self.seconds_per_token(key, path)
            if path != "plain" and len(window) * _rows(key) < self.MIN_SPEC:  # too few prompts for a small loss
                spt = 0.0 if sum(n for _, n in window) < self.CLEAR_TOKENS else spt / self.CLEAR  # ...or any
            rate[path] = spt
        return min(rate, key=rate.__getitem__)

    def seconds_per_token(self, key: tuple, path: str) -> float | None:
        """The path's seconds over tokens in its window, or None before it was measured."""
        obs = self.spt.get(key, {}).get(path)
        return sum(s for s, _ in obs) / max(sum(n for _, n in obs), 1) if obs else None

    def _window(self, key: tuple, paths: tuple[str, ...] = PATHS) -> dict[str, deque[tuple[float, int]]]:
        obs = self.spt.setdefault(key, {})
        for path in paths:
            if path not in obs:
                obs[path] = deque(maxlen=self.WINDOW)
        return obs

    def pick(self, key: tuple, paths: tuple[str, ...] = PATHS) -> str:
        """The path for the next call: each of `paths` once, in order; then the best, and every `gap` calls
        one of the others again (in turn)."""
        obs = self._window(key, paths)
        fresh = next((p for p in paths if not obs[p]), None)
        if fresh is not None:
            return fresh
        best = self.best(key)
        n = self.since[key] = self.since.get(key, 0) + 1
        if n >= self.gap.get(key, self.FIRST_GAP):
            self.since[key] = 0
            others = [p for p in paths if p != best]
            turn = self.turn[key] = self.turn.get(key, -1) + 1
            self.trying[key] = others[turn % len(others)]
            return self.trying[key]
        return best  # type: ignore[return-value]

    def observe(self, key: tuple, path: str, tokens_per_s: float, tokens: int = 1) -> None:
        before = self.best(key)
        self._window(key, (path,))[path].append((tokens / max(tokens_per_s, 1e-9), max(tokens, 1)))
        if self.trying.pop(key, None) == path:  # a re-measurement: did the other path stay behind?
            lost = self.best(key) == before
            self.gap[key] = min(2 * self.gap.get(key, self.FIRST_GAP), self.MAX_GAP) if lost else self.FIRST_GAP


def _rows(key: tuple) -> int:
    """Prompts per call of a path key: its batch (`SpeculativeDecoder.path_key` puts it first)."""
    return key[0] if key and isinstance(key[0], int) and key[0] > 0 else 1
