"""Subscriber: receive captures from a probe session, in this process or another.

    sub = probe.Subscriber(session.endpoint, sites="layers.*.resid_post")
    for cap in sub:                       # blocks until the session ends; or sub.recv(timeout=1.0)
        print(cap.site, cap.step, cap.positions, cap.tensor.shape)
    sub.info                              # the session: model, dtype, sites, run, pid ...
    sub.info.requests[seq_id]             # a vLLM session: {"request_id", "first_position", ...}
    sub.stats.missed                      # captures the session published that never reached us

Frames are validated before anything is built; a malformed message is counted in
`sub.stats` (by fixed category) and skipped, never raised. `Capture.tensor` is a view
on the received ZeroMQ frame (no copy): it stays valid as long as the Capture or the
tensor is referenced; `.clone()` it to keep a private copy.

Latency: by default the session may hold a decode step's captures for its linger (200 ms,
longer where wake-ups cost more, up to `max_delay`) to send several steps at once, which
costs the model less. A subscriber that acts on every token (a drafter, a controller)
passes `live=True`: while one is connected, every step goes out at its end.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import zmq

from ._capture import Capture, capture_of, parse_capture
from ._curve import subscriber_keys
from ._decode import decode_control, decode_group, split_bundle
from ._discovery import SessionInfo
from ._malloc import keep_freed_frames
from ._requests import RequestMap
from ._sites import SiteMatcher
from ._wire import (
    BUNDLE_TOPIC,
    CONTROL,
    END_TOPIC,
    ERROR_KINDS,
    INFO_TOPIC,
    LIVE_PRESENCE,
    PRESENCE,
    REQUESTS_TOPIC,
    TORN_TOPIC,
    WireError,
)


@dataclass
class SubscriberStats:
    """received: captures delivered; missed: published by the session but lost before reaching
    us (sequence gaps, and the end-of-stream counts); malformed: invalid messages, by category
    in `errors` (fixed keys, see probe._wire.ERROR_KINDS); filtered: valid but not asked for;
    torn: captures the session flagged after sending them (may mix old and new values)."""

    received: int = 0
    bytes: int = 0
    malformed: int = 0
    filtered: int = 0
    missed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    torn: int = 0  # captures received that the session flagged as torn afterwards (`Subscriber.torn`)


def _counts(counts: object) -> dict[str, int]:
    """Per-site counts from a control message: an object of whole numbers 0 <= n < 2**63, else WireError."""
    if not isinstance(counts, dict):
        raise WireError("control", "counts are not an object")
    for n in counts.values():
        if type(n) is not int or not 0 <= n < 1 << 63:
            raise WireError("control", "a count is not a whole number")
    return {str(k): n for k, n in counts.items()}


class Subscriber:
    """Connects to `endpoint` (or several) and yields `Capture`s for the requested sites (all by default);
    `live=True` asks the session to send every step at its end (see the module docstring).
    A CURVE session needs `curve_server_key` (its public key), and `curve_client_key=(public, secret)`
    when it admits only listed clients (`probe.attach(..., curve_clients=...)`, `_curve.py`).

    `tune_malloc` (default) sets glibc's malloc thresholds for this process once, so that received
    frames of up to 32 MiB reuse freed memory instead of faulting in fresh pages (`probe/_malloc.py`; the
    process may keep up to 64 MiB of freed heap)."""

    def __init__(self, endpoint: str | list[str], sites: str | Iterable[str] | None = None, *, rcvhwm: int = 1000,
                 curve_server_key: bytes | str | None = None, context: zmq.Context | None = None,
                 live: bool = False, tune_malloc: bool = True,
                 curve_client_key: tuple[bytes | str, bytes | str] | None = None) -> None:
        curve = subscriber_keys(curve_server_key, curve_client_key)  # checked before any socket exists
        if tune_malloc:  # large frames: no page faults per message (see `_malloc.py`; process-wide)
            keep_freed_frames()
        self.endpoint = endpoint
        self.matcher = SiteMatcher(sites)
        self.stats = SubscriberStats()
        self.info: SessionInfo | None = None  # the session's description, once received
        self.end_counts: dict[str, int] | None = None  # per-site published counts, from the end of stream
        self.ended = False  # the session closed and everything it published has been received or counted
        self._next_seq: dict[str, int] = {}  # per site: the seq we expect next
        self._received_by_site: dict[str, int] = {}
        self._warned_version = False
        self._held: deque[Capture] = deque()  # captures that arrived while wait_info looked for the info
        self._requests = RequestMap()  # a vLLM session's seq_id -> request (`info.requests`, `take_requests`)
        # (site, seq) of captures the session flagged as torn after sending them (`_borrow.py`), the last 10,000:
        # such a capture may mix old and new values (a model that wrote into its tensor while it was sent).
        self.torn: deque[tuple[str, int]] = deque(maxlen=10_000)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self._sock.curve_publickey, self._sock.curve_secretkey, self._sock.curve_serverkey = curve
        for topic in self.matcher.topics():
            self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        if not self.matcher.everything:  # b"" already covers the control topics
            self._sock.setsockopt(zmq.SUBSCRIBE, INFO_TOPIC)
            self._sock.setsockopt(zmq.SUBSCRIBE, END_TOPIC)
            self._sock.setsockopt(zmq.SUBSCRIBE, REQUESTS_TOPIC)
            self._sock.setsockopt(zmq.SUBSCRIBE, TORN_TOPIC)
        # Subscribed last: once the publisher sees it, all topic filters above are in place.
        # A live subscriber's presence topic tells the publisher to send every step at its end instead of
        # holding steps for up to its max_delay (see `Publisher.send_bundles`).
        self.presence = (LIVE_PRESENCE if live else PRESENCE) + uuid.uuid4().hex.encode()  # private topic
        self._sock.setsockopt(zmq.SUBSCRIBE, self.presence)
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        for e in endpoints:  # one per pipeline stage on vLLM
            self._sock.connect(e)
        self._publishers = len(endpoints)  # the stream ends with an end-of-stream from each
        self._ended_from: set[str] = set()
        self._closed = False

    def recv(self, timeout: float | None = None) -> Capture | None:
        """Next capture; None once `timeout` seconds have passed (None: wait forever) or at end of stream.

        The timeout is a deadline: filtered, malformed and control messages do not restart it.
        """
        if self._held:
            return self._held.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._sock
        while not self.ended and not self._closed:
            try:
                frames = [sock.recv(zmq.NOBLOCK, copy=False)]
            except zmq.Again:
                if deadline is None:
                    sock.poll(None)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sock.poll(max(1, int(left * 1000 + 0.999)))
                continue
            while frames[-1].more:  # drain the whole message even when it is malformed
                frames.append(sock.recv(copy=False))
            cap = self._handle(frames)
            if cap is not None:
                return cap
            if self._held:  # a bundle's captures
                return self._held.popleft()
        return None

    def _handle(self, frames: list) -> Capture | None:
        buf = frames[0].buffer
        if buf[:1] == b"\x00":
            if len(frames) == 1 and bytes(buf[: len(BUNDLE_TOPIC)]) == BUNDLE_TOPIC:
                return self._bundle(buf)
            if len(frames) == 1 and bytes(buf[: len(CONTROL)]) == CONTROL:
                self._control(bytes(buf))
                return None
            return self._malformed("control", "a control message that is not one")
        return self._accept(frames)

    def _bundle(self, buf: memoryview) -> None:
        """Unpack a bundle: its captures join `_held`, in order, behind any already waiting there."""
        try:
            entries = split_bundle(buf)
        except WireError as exc:
            return self._malformed(exc.kind, str(exc))
        held = self._held
        admit = self._admit
        for entry in entries:  # one capture's frame 0 (payload inline), or a group of them
            try:
                if entry[0] == 0:
                    caps = [Capture(*fields) for fields in decode_group(entry)]
                else:
                    caps = [capture_of(entry, None)]
            except WireError as exc:
                self._wire_error(exc)
                continue
            for cap in caps:
                if admit(cap) is not None:
                    held.append(cap)
        return None

    def _accept(self, frames: list) -> Capture | None:
        try:
            cap = parse_capture(frames)
        except WireError as exc:
            return self._wire_error(exc)
        return self._admit(cap)

    def _wire_error(self, exc: WireError) -> None:
        if exc.kind == "version" and not self._warned_version:
            self._warned_version = True
            warnings.warn(f"probebus: {exc} (from {self.endpoint})", stacklevel=5)
        return self._malformed(exc.kind, str(exc))

    def _admit(self, cap: Capture) -> Capture | None:
        """Count a well-formed capture (sequence gaps, per-site totals); None when this subscriber filters it."""
        if not self.matcher.everything and not self.matcher.matches(cap.site):
            self.stats.filtered += 1
            return None
        site = cap.site
        expect = self._next_seq.get(site)
        if expect is None:
            # A late joiner can receive captures before the session's info (the publisher's I/O thread applies a
            # subscription before the model's thread reads it and sends the info, up to 100 ms of steps later):
            # until an info says what was published before we joined, our first capture of a site is the start.
            expect = 0 if self.info is not None else cap.seq
        if cap.seq > expect:
            self.stats.missed += cap.seq - expect
        self._next_seq[site] = cap.seq + 1
        self._received_by_site[site] = self._received_by_site.get(site, 0) + 1
        self.stats.received += 1
        self.stats.bytes += cap.n_tokens * cap.hidden * cap.dtype.itemsize
        return cap

    def _malformed(self, kind: str, _message: str) -> None:
        stats = self.stats
        stats.malformed += 1
        key = kind if kind in ERROR_KINDS else "other"
        stats.errors[key] = stats.errors.get(key, 0) + 1
        return None

    def _control(self, frame: bytes) -> None:
        """Apply a control message, or count it malformed and change nothing: every field is checked before any
        state changes (a bad end of stream must not end the stream, a bad info must not replace a good one)."""
        try:
            if frame.startswith(INFO_TOPIC):
                body = decode_control(frame, INFO_TOPIC)
                counts = _counts(body.get("counts") or {})
                info = SessionInfo.from_dict(body)
                self.info = dataclasses.replace(info, requests=self._requests.from_info(info.requests))
                for site, n in counts.items():  # published before we joined: not missed
                    self._next_seq.setdefault(site, n)
            elif frame.startswith(END_TOPIC):
                self._end(decode_control(frame, END_TOPIC))
            elif frame.startswith(REQUESTS_TOPIC):
                body = decode_control(frame, REQUESTS_TOPIC)
                recomputed = body.get("recomputed")
                if recomputed is not None:
                    recomputed = _counts({"recomputed": recomputed})["recomputed"]
                if self._requests.from_delta(body.get("requests") or {}) and not self.ended:
                    # A lost message: re-announcing our presence makes the publisher send its whole map again.
                    self._sock.setsockopt(zmq.UNSUBSCRIBE, self.presence)
                    self._sock.setsockopt(zmq.SUBSCRIBE, self.presence)
                if self.info is not None and recomputed is not None:
                    self.info = dataclasses.replace(self.info, recomputed=recomputed)
            elif frame.startswith(TORN_TOPIC):
                body = decode_control(frame, TORN_TOPIC)
                site, seq = body.get("site"), body.get("seq")
                if not isinstance(site, str) or type(seq) is not int or seq < 0:
                    raise WireError("control", "a torn flag without site and seq")
                if self.matcher.everything or self.matcher.matches(site):
                    self.torn.append((site, seq))
                    self.stats.torn += 1
            # other control topics are for newer versions: ignored, not malformed
        except (WireError, TypeError, ValueError, OverflowError, RecursionError, AttributeError):
            self._malformed("control", "bad control message")

    def _end(self, body: dict) -> None:
        ends = _counts(body.get("counts"))
        source = str(body.get("endpoint", ""))
        if source in self._ended_from:  # the publisher repeats it until acknowledged
            return
        self._ended_from.add(source)
        for site, n in ends.items():  # what never arrived at the tail of each site's stream
            if self.matcher.everything or self.matcher.matches(site):
                self.stats.missed += max(0, n - self._next_seq.get(site, 0))
        self.end_counts = {**(self.end_counts or {}), **ends}
        if len(self._ended_from) >= self._publishers:
            self.ended = True  # acknowledge, so the publishers may close their sockets
            self._sock.setsockopt(zmq.UNSUBSCRIBE, self.presence)

    def take_requests(self) -> list[dict]:
        """A vLLM session's request-map entries ({"seq_id", "request_id", "first_position"}) that arrived since
        the last call, in arrival order; `info.requests` keeps them all (the last 100,000)."""
        return self._requests.take()

    def wait_info(self, timeout: float = 5.0) -> SessionInfo | None:
        """The session's description, waiting up to `timeout` s for it (None: nobody serves the endpoint).

        Captures that arrive meanwhile are not lost: they stay queued for `recv`."""
        deadline = time.monotonic() + timeout
        while self.info is None and not self._closed and time.monotonic() < deadline:
            if not self._sock.poll(50):
                continue
            try:  # only control messages are taken here; captures wait for recv
                msg = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            frames = [msg]
            while frames[-1].more:
                frames.append(self._sock.recv(copy=False))
            cap = self._handle(frames)
            if cap is not None:
                self._held.append(cap)
        return self.info

    def __iter__(self) -> Iterator[Capture]:
        """Every capture until the session closes (end of stream)."""
        return self.iter(None)

    def iter(self, idle_timeout: float | None = None) -> Iterator[Capture]:
        """Yield captures until the end of stream, or until none arrives for `idle_timeout` s."""
        while not self._closed:
            cap = self.recv(timeout=idle_timeout)
            if cap is None:
                return
            yield cap

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
