"""What a probe session reports and the policies it runs under: one vocabulary for both backends.

    session.stats                  # ProbeStats(captured=..., published=..., dropped=..., queued=..., ...)
    s.captured == s.published + s.dropped + s.queued
    attach(model, sites, policy="complete")     # one of POLICIES

`probe.attach`'s `ProbeSession` (`_session.py`) and `probe.vllm.attach`'s `VllmSession`
(`vllm/_client.py`, summed over the engine's workers) return the same `ProbeStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("complete", "best_effort")


@dataclass(frozen=True)
class ProbeStats:
    """Counters of one session. `captured == published + dropped + queued` at every moment.

    published   handed to ZeroMQ (each subscriber reports what it missed after that:
                `SubscriberStats.missed`)
    dropped     no room under best_effort, a failed copy, or refused after the stall limit
    queued      staged and not yet sent: the running step's captures (sent at its end), steps
                held for a later send (no live subscriber; at most a linger old while the model
                steps, ~50 ms more once it stops: see `max_delay`) and device copies in flight (CUDA); 0 after close
    degraded    `complete` hit `stall_timeout` and stopped blocking on a full subscriber
    torn        large captures borrowed from the model's own tensor (`borrow`) that the model wrote into in
                place after their hook: one written before its send is dropped (never sent), one written
                while ZeroMQ sent it may mix old and new values and is flagged to subscribers in-band
                (`Subscriber.torn`); the session copies every capture after the first
    """

    captured: int
    published: int
    dropped: int
    bytes: int
    stall_seconds: float
    subscribers: int
    queued: int = 0
    degraded: bool = False
    torn: int = 0
