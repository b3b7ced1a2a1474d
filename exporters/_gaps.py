"""Detecting captures a subscriber never received, from the captures it did receive.

    gaps = GapCounter()
    gaps.observe("run1", 7, "layers.0.resid_post")   # -> 0
    gaps.observe("run1", 7, "layers.1.resid_post")   # -> 0
    gaps.observe("run1", 8, "layers.1.resid_post")   # -> 0 (layers.0 may still come)
    gaps.observe("run1", 9, "layers.0.resid_post")   # -> 1: step 8 happened, layers.0 missed it
    gaps.total                                        # 1

The wire carries no sequence number, but `step` is a monotonic forward counter and
every site of one forward sees the same valid tokens, so a site that skips a step
other sites were seen at lost that capture (`best_effort` drops, for instance). A
whole step lost at every site is invisible here; the publisher's own `dropped`
counter covers that. Sites removed and re-added mid-run would read as gaps.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict


class _Run:
    __slots__ = ("steps", "last")

    def __init__(self) -> None:
        self.steps: list[int] = []  # distinct steps seen, ascending (captures arrive in step order)
        self.last: dict[str, int] = {}


class GapCounter:
    def __init__(self, window: int = 100_000) -> None:
        self.window = window
        self.total = 0
        self.by_site: dict[str, int] = defaultdict(int)
        self._runs: dict[str, _Run] = {}

    def observe(self, run: str, step: int, site: str) -> int:
        r = self._runs.get(run)
        if r is None:
            r = self._runs[run] = _Run()
        steps = r.steps
        if not steps or step > steps[-1]:
            steps.append(step)
            if len(steps) > 2 * self.window:  # bounded memory on endless sessions
                del steps[: len(steps) - self.window]
        prev = r.last.get(site)
        r.last[site] = step
        if prev is None or step <= prev + 1:
            return 0
        missed = bisect_right(steps, step - 1) - bisect_right(steps, prev)
        if missed > 0:
            self.total += missed
            self.by_site[site] += missed
        return missed
