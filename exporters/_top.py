"""A live per-site view of a running probe session, as data (the CLI renders it).

    mon = TopMonitor("ipc:///tmp/probebus-xyz/bus")
    while True:
        mon.poll(1.0)                  # receive for one second
        for r in mon.snapshot():       # one SiteRates per site, in model order
            r.site, r.captures_per_s, r.tokens_per_s, r.bytes_per_s, r.gaps, r.lag_steps, r.idle_s
    mon.close()

Rates are over the last `window` seconds. `gaps` are captures this monitor missed
(the bus' per-site sequence numbers; with an older publisher: a site that skipped a
step other sites reported). `lag_s` is how long ago the newest capture of a site was
published when it arrived here (the wire carries the time its step was packed for sending,
so a step the session held for a later send, for its linger, shows that wait; same
clock when the session runs on this machine); `lag_steps` how far a site trails the newest step seen
at any site; `idle_s` the time since its last capture. `busy` is the share of time
this monitor found a message already waiting; near 1.0 means the monitor itself
cannot keep up and its numbers trail the session. `ended` turns True when the
session closes; `poll` then returns at once instead of spinning.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import probe

from ._gaps import GapCounter
from ._recording import site_order


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
    lag_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Counts:
    __slots__ = ("layer", "captures", "tokens", "bytes", "last_step", "last_t", "lag", "next_seq", "missed",
                 "history")

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.captures = self.tokens = self.bytes = 0
        self.last_step = -1
        self.last_t = 0.0
        self.lag: float | None = None
        self.next_seq = 0
        self.missed = 0
        self.history: deque[tuple[float, int, int, int]] = deque()


class TopMonitor:
    def __init__(self, endpoint: str, sites: Any = None, *, window: float = 2.0,
                 curve_server_key: bytes | str | None = None,
                 curve_client_key: tuple[bytes | str, bytes | str] | None = None) -> None:
        self.endpoint = endpoint
        self.window = window
        self.sub = probe.Subscriber(endpoint, sites, curve_server_key=curve_server_key,
                                    curve_client_key=curve_client_key)
        self.gaps = GapCounter()
        self.sites: dict[str, _Counts] = {}
        self.runs: set[str] = set()
        self.max_step = -1
        self.started = time.monotonic()
        self._waited = 0.0
        self._busy_window: deque[tuple[float, float]] = deque()

    @property
    def ended(self) -> bool:
        """The session closed (its end of stream arrived): nothing more will come."""
        return bool(getattr(self.sub, "ended", False))

    def wait_info(self, timeout: float) -> Any:
        """The session's description (probe.SessionInfo), or None if nobody serves the endpoint."""
        wait = getattr(self.sub, "wait_info", None)
        return wait(timeout) if wait is not None else None

    def poll(self, seconds: float) -> int:
        """Receive for `seconds` (less once the session ended); returns how many captures arrived."""
        end = time.monotonic() + seconds
        got = 0
        waited = 0.0
        while True:
            now = time.monotonic()
            if now >= end or self.ended:  # after the end of stream recv returns at once: do not spin on it
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
            c.bytes += cap.n_tokens * cap.hidden * cap.dtype.itemsize  # no tensor view needed
            c.last_step = cap.step
            c.last_t = now
            sent = getattr(cap, "sent_at", None)
            c.lag = max(0.0, time.time() - sent) if sent else None
            seq = getattr(cap, "seq", None)
            if seq is not None:
                if c.captures > 1:  # a late joiner counts from the first capture it saw of each site
                    c.missed += max(0, seq - c.next_seq)
                c.next_seq = seq + 1
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
        for site in sorted(self.sites, key=site_order):
            c = self.sites[site]
            t0, k0, n0, b0 = c.history[0]
            inv = 1.0 / (now - t0) if now > t0 else 0.0
            out.append(SiteRates(site, c.layer, c.captures, c.tokens, c.bytes, (c.captures - k0) * inv,
                                 (c.tokens - n0) * inv, (c.bytes - b0) * inv, self._missed(site, c),
                                 c.last_step, max(0, self.max_step - c.last_step), now - c.last_t, c.lag))
        return out

    def _missed(self, site: str, c: _Counts) -> int:
        if c.next_seq:  # sequence numbers on the wire: exact
            return c.missed + max(0, (getattr(self.sub, "end_counts", None) or {}).get(site, 0) - c.next_seq)
        return self.gaps.by_site.get(site, 0)

    def totals(self) -> dict[str, Any]:
        snap = self.snapshot()
        return {"endpoint": self.endpoint, "runs": sorted(self.runs), "seconds": time.monotonic() - self.started,
                "captures": sum(r.captures for r in snap), "bytes": sum(r.bytes for r in snap),
                "captures_per_s": sum(r.captures_per_s for r in snap), "bytes_per_s": sum(r.bytes_per_s for r in snap),
                "gaps": sum(r.gaps for r in snap), "malformed": self.sub.stats.malformed, "busy": self.busy,
                "max_step": self.max_step, "ended": self.ended, "sites": [r.as_dict() for r in snap]}

    def close(self) -> None:
        self.sub.close()

    def __enter__(self) -> TopMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
