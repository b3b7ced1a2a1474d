"""Subscriber: receive captures from a probe session, in this process or another.

    sub = probe.Subscriber(session.endpoint, sites="layers.*.resid_post")
    for cap in sub:                       # blocks; or sub.recv(timeout=1.0)
        print(cap.site, cap.step, cap.positions, cap.tensor.shape)

Frames are validated before anything is built; a malformed message is counted in
`sub.stats` and skipped, never raised. `Capture.tensor` is a view on the received
ZeroMQ frame (no copy); clone it if you keep it past the frame's lifetime needs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import zmq

from ._publisher import END_OF_STREAM, PRESENCE
from ._sites import SiteMatcher
from ._wire import Header, WireError, decode_header


@dataclass(slots=True)
class Capture:
    """One forward step x one site: valid tokens only, each with its own identity."""

    site: str
    layer: int
    phase: str
    step: int
    run: str
    seq_ids: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n]
    token_ids: torch.Tensor  # int64 [n]
    tensor: torch.Tensor  # [n, hidden], captured dtype

    @property
    def n_tokens(self) -> int:
        return self.tensor.shape[0]


@dataclass
class SubscriberStats:
    received: int = 0
    bytes: int = 0
    malformed: int = 0
    filtered: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def parse_capture(frames: list) -> Capture:
    """Validate and decode one multipart message (raises WireError)."""
    if len(frames) != 4:
        raise WireError(f"expected 4 frames (topic, header, tokens, payload), got {len(frames)}")
    topic, head, tokens, payload = frames
    h: Header = decode_header(head.buffer)
    if topic.bytes != h.site.encode():
        raise WireError(f"topic {topic.bytes[:64]!r} does not match header site {h.site!r}")
    n = h.n_tokens
    if len(tokens) != 24 * n:
        raise WireError(f"token frame has {len(tokens)} bytes, expected {24 * n} for {n} tokens")
    if len(payload) != h.payload_nbytes:
        raise WireError(f"payload has {len(payload)} bytes, expected {h.payload_nbytes} ({n} x {h.hidden} {h.dtype})")
    if n == 0 or h.hidden == 0:
        raise WireError("empty capture")
    ids = torch.frombuffer(tokens.buffer, dtype=torch.int64).view(3, n)
    tensor = torch.frombuffer(payload.buffer, dtype=h.dtype).view(n, h.hidden)
    return Capture(h.site, h.layer, h.phase, h.step, h.run, ids[0], ids[1], ids[2], tensor)


class Subscriber:
    """Connects to `endpoint` and yields `Capture`s for the requested sites (all by default)."""

    def __init__(self, endpoint: str, sites: str | Iterable[str] | None = None, *, rcvhwm: int = 1000,
                 curve_server_key: bytes | None = None, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.matcher = SiteMatcher(sites)
        self.stats = SubscriberStats()
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            public, secret = zmq.curve_keypair()
            self._sock.curve_publickey, self._sock.curve_secretkey = public, secret
            self._sock.curve_serverkey = curve_server_key
        for topic in self.matcher.topics():
            self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        # Subscribed last: once the publisher sees it, all topic filters above are in place.
        self._presence = PRESENCE + uuid.uuid4().hex.encode()
        self._sock.setsockopt(zmq.SUBSCRIBE, self._presence)
        self._sock.connect(endpoint)
        self._closed = False
        self.ended = False  # the session closed and everything it published has been received

    def recv(self, timeout: float | None = None) -> Capture | None:
        """Next capture; None after `timeout` seconds (None: wait forever) or at end of stream."""
        deadline_ms = None if timeout is None else int(timeout * 1000)
        while not self.ended:
            if not self._sock.poll(deadline_ms if deadline_ms is not None else -1):
                return None
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) == 2 and frames[0].bytes == self._presence and frames[1].bytes == END_OF_STREAM:
                self.ended = True  # acknowledge, so the publisher may close its socket
                self._sock.setsockopt(zmq.UNSUBSCRIBE, self._presence)
                return None
            try:
                cap = parse_capture(frames)
            except WireError as exc:
                self.stats.malformed += 1
                key = str(exc).split(":")[0][:60]
                self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
                continue
            if not self.matcher.matches(cap.site):
                self.stats.filtered += 1
                continue
            self.stats.received += 1
            self.stats.bytes += len(frames[3])
            return cap
        return None

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
