"""Bundles held for a later send: one wake-up of ZeroMQ's I/O thread per batch of steps.

    class Publisher(HeldBundles): ...              # `_publisher.py`
    pub.send_bundles(bundles, hold=True)           # a step's end: kept unless due, a live subscriber, or 1 MiB
    pub.flush_held()                               # now (close, pause, `session.flush()`, the control thread)
    pub.linger                                     # how old held bundles get before they go, in seconds

Unless a subscriber is *live* (`Subscriber(live=True)`: a drafter, a controller that acts
on each token), the step's bundles are held and sent with later steps' once the oldest is
old enough (the *linger*) or 1 MiB are held, like TCP's Nagle or Kafka's linger. The send
that finds ZeroMQ's I/O thread asleep wakes it on another core, and that costs the model's
thread what this machine charges for a cross-core wake-up, which varies by orders of
magnitude from machine to machine and day to day (`benchmarks/wakeup.py`; the figures:
docs/design.md, "Costs behind the code"). So the linger adapts: it is 100
times the median cost of the last 8 such sends (the bus's wake-ups stay near 1 % of the
model thread's time), never under 200 ms and never over `max_delay` (0.5 s by default).
(The 200 ms floor, against 50, sent held bundles less often at no visible cost: the A/B is in
docs/design.md, "Costs behind the code".)
A recorder or a live view loses nothing by it: the control thread sends what is held once
it is a linger old, so a model that stops stepping strands nothing for longer than
~linger + 50 ms, and `close()` sends all of it before the end of stream. A live
subscriber's presence switches holding off from the step at which the model's thread
reads it (it reads subscriptions every 100 ms of steps; `wait_for_subscribers` reads them
at once).

A mixin of `Publisher`, which owns the socket, the send path (`send_bundle`) and `live`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

from ._wire import BUNDLE_MAX, BUNDLE_TOPIC

MAX_DELAY_S = 0.5  # default: the most held bundles may linger (no live subscriber)
MIN_LINGER_S = 0.2  # held bundles linger at least this long (unless max_delay is shorter)
_WAKE_BUDGET = 100  # linger = this x a burst send's cost: the wake-ups take ~1 % of the model thread
_HOLD_MAX = 1 << 20  # bytes of held bundles that go at once, whatever their age


class HeldBundles:
    live: bool  # Publisher's (see the module docstring), as are `send_bundle` and `_queue_control`

    def _init_held(self, max_delay: float) -> None:
        self.max_delay = max(0.0, float(max_delay))
        # Bundles waiting for later steps, and control messages between them (meta None: `hold_control`).
        self._held: list[tuple[bytearray | bytes, list[tuple[bytes, int, int]] | None]] = []
        self._held_bytes = 0
        self._held_since = 0.0
        self._held_count = 0  # captures in them
        self._linger = min(self.max_delay, MIN_LINGER_S)  # how old held bundles get before they go (adapts)
        self._burst_s: deque[float] = deque(maxlen=8)  # what the model thread's last held sends cost it
        # Held by whoever hands held bundles to ZeroMQ (the model's thread, or the control thread for a model
        # that stopped stepping), so that they leave in order and never interleave with newer ones.
        self._order = threading.Lock()

    def send_bundles(self, bundles: list[tuple[bytearray, list[tuple[bytes, int, int]]]], *,
                     hold: bool = False, since: float | None = None) -> None:
        """Hand bundles to ZeroMQ after any held before them; with `hold` (a step's end), keep them for a later
        step's send unless a live subscriber is present or the oldest held is `max_delay` old. `since`: when
        the oldest of `bundles` was captured, if earlier than now (steps packed late, `_pending.py`)."""
        with self._order:
            if hold and self._holding:
                now = time.monotonic()
                if not self._held:
                    self._held_since = now if since is None else since
                for buf, meta in bundles:
                    self._hold(buf, meta)
                if now - self._held_since < self._linger and self._held_bytes < _HOLD_MAX:
                    return
                t0 = time.perf_counter()
                self._send_held()
                self._adapt(time.perf_counter() - t0)
                return
            if self._held:
                self._send_held()
            for buf, meta in bundles:
                self.send_bundle(buf, meta)

    @property
    def _holding(self) -> bool:
        """A step's end keeps what it sends for later: no live subscriber, and a linger at all."""
        return not self.live and self.max_delay > 0

    def hold_control(self, frame: bytes) -> bool:
        """Keep a control message with the held bundles, to leave in order with them; False when nothing is
        being held (a live subscriber, or no linger): the caller sends it now."""
        if not self._holding:
            return False
        with self._order:
            if not self._held:
                self._held_since = time.monotonic()
            self._held.append((frame, None))
        return True

    def _adapt(self, cost: float) -> None:
        """Set the linger from what the model thread's held sends cost it (mostly the wake-up of ZeroMQ's I/O
        thread on another core: microseconds on most machines, milliseconds on some VMs)."""
        self._burst_s.append(cost)
        wake = statistics.median(self._burst_s)
        self._linger = min(self.max_delay, max(MIN_LINGER_S, _WAKE_BUDGET * wake))

    @property
    def linger(self) -> float:
        """Seconds held bundles wait now before the model's thread sends them (no live subscriber)."""
        return self._linger

    @property
    def held(self) -> int:
        """Captures in bundles held for a later send."""
        return self._held_count

    def held_due(self) -> bool:
        """Captures are held that a step's end would send now: the oldest is a linger old, 1 MiB are held, or
        nothing is to be held any more (a live subscriber came, `send_bundles`)."""
        return bool(self._held_count) and (not self._holding or self._held_bytes >= _HOLD_MAX
                                           or time.monotonic() - self._held_since >= self._linger)

    def _hold(self, buf: bytearray, meta: list[tuple[bytes, int, int]]) -> None:
        """Keep a bundle for later, appended to the last held one while that stays within BUNDLE_MAX."""
        held = self._held
        if held and held[-1][1] is not None and len(held[-1][0]) + len(buf) - len(BUNDLE_TOPIC) <= BUNDLE_MAX:
            held[-1][0].extend(memoryview(buf)[len(BUNDLE_TOPIC):])  # type: ignore[union-attr]
            held[-1][1].extend(meta)
        else:
            held.append((buf, meta))
        self._held_bytes += len(buf)
        self._held_count += len(meta)

    def _send_held(self) -> None:
        """Send every held bundle (under `_order`)."""
        held = self._held
        self._held, self._held_bytes, self._held_count = [], 0, 0
        for buf, meta in held:
            if meta is None:
                self._queue_control(buf)  # type: ignore[arg-type]
            else:
                self.send_bundle(buf, meta)  # type: ignore[arg-type]

    def flush_held(self, *, blocking: bool = True) -> None:
        """Send what is held now (close, pause; the control thread once it is a linger old)."""
        if not self._held or not self._order.acquire(blocking=blocking):
            return
        try:
            if self._held:
                self._send_held()
        finally:
            self._order.release()
