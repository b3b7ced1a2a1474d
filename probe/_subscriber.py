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

import numpy as np
import torch
import zmq

from ._publisher import END_OF_STREAM, PRESENCE
from ._sites import SiteMatcher
from ._wire import WireError, decode_envelope


class Capture:
    """One forward step x one site: valid tokens only, each with its own identity.

    `tensor` ([n, hidden], captured dtype) and the int64 `seq_ids`, `positions`,
    `token_ids` are views on the received frames, built on first access; `payload`
    and `token_array` give the same memory as a memoryview / numpy array.
    """

    __slots__ = ("site", "layer", "phase", "step", "run", "dtype", "hidden", "n_tokens",
                 "_tokens", "_payload", "_tensor", "_ids")

    def __init__(self, site: str, layer: int, phase: str, step: int, run: str, dtype: torch.dtype, hidden: int,
                 n_tokens: int, tokens: memoryview, payload: memoryview) -> None:
        self.site, self.layer, self.phase, self.step, self.run = site, layer, phase, step, run
        self.dtype, self.hidden, self.n_tokens = dtype, hidden, n_tokens
        self._tokens, self._payload = tokens, payload
        self._tensor: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.frombuffer(self._payload, dtype=self.dtype).view(self.n_tokens, self.hidden)
        return self._tensor

    def _id_rows(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = torch.frombuffer(self._tokens, dtype=torch.int64).view(3, self.n_tokens)
        return self._ids

    @property
    def seq_ids(self) -> torch.Tensor:
        return self._id_rows()[0]

    @property
    def positions(self) -> torch.Tensor:
        return self._id_rows()[1]

    @property
    def token_ids(self) -> torch.Tensor:
        return self._id_rows()[2]

    @property
    def token_array(self) -> np.ndarray:
        """int64 [3, n]: seq_id, position, token_id rows (a view, no copy)."""
        return np.frombuffer(self._tokens, dtype=np.int64).reshape(3, self.n_tokens)

    @property
    def payload(self) -> memoryview:
        """The activation bytes, C-contiguous [n, hidden] in `dtype` (a view, no copy)."""
        return self._payload

    def __repr__(self) -> str:
        return (f"Capture(site={self.site!r}, phase={self.phase!r}, step={self.step}, n_tokens={self.n_tokens}, "
                f"hidden={self.hidden}, dtype={self.dtype})")


@dataclass
class SubscriberStats:
    received: int = 0
    bytes: int = 0
    malformed: int = 0
    filtered: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def parse_capture(frames: list) -> Capture:
    """Validate and decode one multipart message (raises WireError)."""
    if len(frames) not in (1, 2):
        raise WireError(f"expected 1 or 2 frames (envelope[, payload]), got {len(frames)}")
    h, tokens, payload = decode_envelope(frames[0].buffer, frames[1].buffer if len(frames) == 2 else None)
    return Capture(h.site, h.layer, h.phase, h.step, h.run, h.dtype, h.hidden, h.n_tokens, tokens, payload)


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
        self.presence = PRESENCE + uuid.uuid4().hex.encode()  # this subscriber's private topic
        self._sock.setsockopt(zmq.SUBSCRIBE, self.presence)
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
            if len(frames) == 2 and frames[1].bytes == END_OF_STREAM and frames[0].bytes == self.presence:
                self.ended = True  # acknowledge, so the publisher may close its socket
                self._sock.setsockopt(zmq.UNSUBSCRIBE, self.presence)
                return None
            try:
                cap = parse_capture(frames)
            except WireError as exc:
                self.stats.malformed += 1
                key = str(exc).split(":")[0][:60]
                self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
                continue
            if not self.matcher.everything and not self.matcher.matches(cap.site):
                self.stats.filtered += 1
                continue
            self.stats.received += 1
            self.stats.bytes += len(cap.payload)
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
