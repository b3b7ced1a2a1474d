"""A live per-site view of a running probe session, as data (the CLI renders it).

    mon = TopMonitor("ipc:///tmp/probebus-xyz/bus")
    while True:
        mon.poll(1.0)                  # receive for one second
        for r in mon.snapshot():       # one SiteRates per site, in model order
            r.site, r.captures_per_s, r.tokens_per_s, r.bytes_per_s, r.gaps, r.lag_steps, r.idle_s
    mon.close()

Rates are over the last `window` seconds. `gaps` are captures detected missing (a
site skipped a step other sites reported: best_effort drops). The wire carries no
send time, so lag is given in steps: how far a site's newest capture trails the
newest step seen at any site, plus `idle_s` since its last capture. `busy` is the
share of time this monitor found a message already waiting; near 1.0 means the
monitor itself cannot keep up and its numbers trail the session.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import probe

from ._gaps import GapCounter


@dataclass(frozen=True)
class SiteRates:
    site: str
    layer: int
    captures: int
    tokens: int
    bytes: int
    captures_per_s: float
    tokens_per_s: float
    bytes_per_s: float
    gaps: int
    last_step: int
    lag_steps: int
    idle_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Counts:
    __slots__ = ("layer", "captures", "tokens", "bytes", "last_step", "last_t", "history")

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.captures = self.tokens = self.bytes = 0
        self.last_step = -1
        self.last_t = 0.0
        self.history: deque[tuple[float, int, int, int]] = deque()


def _site_order(site: str) -> tuple[int, int, str]:
    if site.startswith("layers."):
        return (1, int(site.split(".")[1]), site)
    return (0 if site == "embed" else 2, 0, site)


class TopMonitor:
    def __init__(self, endpoint: str, sites: Any = None, *, window: float = 2.0) -> None:
        self.endpoint = endpoint
        self.window = window
        self.sub = probe.Subscriber(endpoint, sites)
        self.gaps = GapCounter()
        self.sites: dict[str, _Counts] = {}
        self.runs: set[str] = set()
        self.max_step = -1
        self.started = time.monotonic()
        self._waited = 0.0
        self._busy_window: deque[tuple[float, float]] = deque()

    def poll(self, seconds: float) -> int:
        """Receive for `seconds`; returns how many captures arrived."""
        end = time.monotonic() + seconds
        got = 0
        waited = 0.0
        while True:
            now = time.monotonic()
            if now >= end:
                break
            cap = self.sub.recv(timeout=0)
            if cap is None:  # nothing waiting: we are keeping up; sleep in poll until the next one
                t0 = time.monotonic()
                cap = self.sub.recv(timeout=max(0.001, end - t0))
                waited += time.monotonic() - t0
                if cap is None:
                    continue
            got += 1
            now = time.monotonic()
            c = self.sites.get(cap.site)
            if c is None:
                c = self.sites[cap.site] = _Counts(cap.layer)
                c.history.append((self.started, 0, 0, 0))
            c.captures += 1
            c.tokens += cap.n_tokens
            c.bytes += cap.tensor.numel() * cap.tensor.element_size()
            c.last_step = cap.step
            c.last_t = now
            self.runs.add(cap.run)
            self.max_step = max(self.max_step, cap.step)
            self.gaps.observe(cap.run, cap.step, cap.site)
        now = time.monotonic()
        for c in self.sites.values():  # one sample per poll; rates span the last `window` seconds
            c.history.append((now, c.captures, c.tokens, c.bytes))
            while len(c.history) > 2 and now - c.history[1][0] >= self.window:
                c.history.popleft()
        self._busy_window.append((seconds, waited))
        while len(self._busy_window) > 1 and sum(s for s, _ in self._busy_window) > self.window:
            self._busy_window.popleft()
        return got

    @property
    def busy(self) -> float:
        total = sum(s for s, _ in self._busy_window)
        return 0.0 if total <= 0 else max(0.0, 1.0 - sum(w for _, w in self._busy_window) / total)

    def snapshot(self) -> list[SiteRates]:
        now = time.monotonic()
        out = []
        for site in sorted(self.sites, key=_site_order):
            c = self.sites[site]
            t0, k0, n0, b0 = c.history[0]
            inv = 1.0 / (now - t0) if now > t0 else 0.0
            out.append(SiteRates(site, c.layer, c.captures, c.tokens, c.bytes, (c.captures - k0) * inv,
                                 (c.tokens - n0) * inv, (c.bytes - b0) * inv, self.gaps.by_site.get(site, 0),
                                 c.last_step, max(0, self.max_step - c.last_step), now - c.last_t))
        return out

    def totals(self) -> dict[str, Any]:
        snap = self.snapshot()
        return {"endpoint": self.endpoint, "runs": sorted(self.runs), "seconds": time.monotonic() - self.started,
                "captures": sum(r.captures for r in snap), "bytes": sum(r.bytes for r in snap),
                "captures_per_s": sum(r.captures_per_s for r in snap), "bytes_per_s": sum(r.bytes_per_s for r in snap),
                "gaps": self.gaps.total, "malformed": self.sub.stats.malformed, "busy": self.busy,
                "max_step": self.max_step, "sites": [r.as_dict() for r in snap]}

    def close(self) -> None:
        self.sub.close()

    def __enter__(self) -> TopMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
