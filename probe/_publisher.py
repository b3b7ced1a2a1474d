"""The publisher thread: the only code that touches the ZeroMQ socket.

Hooks append `Staged` descriptors to a deque and return; this thread encodes headers,
sends the four frames and frees ring space once ZeroMQ no longer needs it. It sleeps
in `zmq.Poller` on the socket (for subscription messages) and a self-pipe doorbell
that producers ring at most once per forward step, so a decode step costs one wake-up,
not one per capture.

The socket is XPUB with XPUB_NODROP: ZeroMQ never drops silently at the high-water
mark; a full pipe makes the send fail with EAGAIN. `complete` retries (back-pressure
reaches the hooks through the bounded ring), `best_effort` counts the capture as dropped.
Subscribers announce themselves with a private presence topic, so the publisher can
count them (`wait_for_subscribers`) without any extra socket.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from ._staging import StagingRing
from ._wire import encode_envelope

PRESENCE = b"\x00probebus/subscriber/"
END_OF_STREAM = b"probebus:end-of-stream"
# Closed publishers whose sockets still wait for end-of-stream acknowledgements, by endpoint.
_LINGERING: weakref.WeakValueDictionary[str, Publisher] = weakref.WeakValueDictionary()


@atexit.register
def _finish_lingering() -> None:
    """Let closed sockets finish their end-of-stream before the interpreter kills daemon threads
    (killing one inside libzmq aborts the process with "terminate called without an active exception")."""
    for pub in list(_LINGERING.values()):
        pub._thread.join(min(2.0, pub._linger_ms / 1000))
ZERO_COPY_MIN = zmq.COPY_THRESHOLD  # below this pyzmq copies anyway; a memcpy beats a tracker


@dataclass(slots=True)
class Staged:
    """One capture waiting to be sent."""

    topic: bytes
    layer: int
    step: int
    phase: int
    dtype: int
    hidden: int
    n: int
    tokens: np.ndarray  # int64 [3, n], owned (never reused)
    data: np.ndarray  # uint8 bytes of the payload (a ring slice unless in_ring is False)
    in_ring: bool
    event: object = None  # torch.cuda.Event gating a device-to-host copy


class Publisher:
    def __init__(self, endpoint: str, *, run: str, policy: str, ring: StagingRing, sndhwm: int,
                 curve_secret_key: bytes | None = None, background: bool = True) -> None:
        self.requested_endpoint = endpoint
        self.background = background
        self.endpoint = ""
        self.run = run.encode()
        self.complete = policy == "complete"
        self.ring = ring
        self.sndhwm = sndhwm
        self.curve_secret_key = curve_secret_key
        self.queue: deque[Staged] = deque()
        self.published = 0
        self.dropped = 0
        self.bytes = 0
        self.subscribers: set[bytes] = set()
        self._sub_cond = threading.Condition()
        self._sleeping = False
        self._closing = False
        self._abort = False
        self._linger_ms = 30_000
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._ready = threading.Event()
        self._flushed = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="probebus-publisher", daemon=True)

    # --- producer side -------------------------------------------------------------
    def start(self) -> None:
        old = _LINGERING.get(self.requested_endpoint)
        if old is not None:  # our own closed socket may still hold this address for its end-of-stream
            old._thread.join(old._linger_ms / 1000)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def submit(self, item: Staged) -> None:
        self.queue.append(item)

    def kick(self) -> None:
        """Wake the thread if it sleeps (cheap no-op otherwise)."""
        if self._sleeping and self._wfd >= 0:
            try:
                os.write(self._wfd, b"!")
            except (BlockingIOError, OSError):
                pass

    def _wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (kicking the thread so it reads subscriptions) until `ready()`; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._sub_cond:
            while not ready():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.kick()
                self._sub_cond.wait(0.05 if left is None else min(left, 0.05))
            return True

    def wait_for_subscribers(self, n: int, timeout: float | None) -> int:
        self._wait_until(lambda: len(self.subscribers) >= n, timeout)
        return len(self.subscribers)

    def wait_for_presence(self, presence: bytes, timeout: float | None) -> bool:
        return self._wait_until(lambda: presence in self.subscribers, timeout)

    def close(self, timeout: float) -> bool:
        """Send everything queued; False if it had to give up after `timeout`.

        Returns once every capture is handed to ZeroMQ. The socket itself stays open in
        the background until each subscriber has acknowledged the end-of-stream (or
        left), at most `timeout` seconds: closing an ipc:// socket under a lagging
        reader makes the kernel hang up on it and libzmq drop what it had not read yet.
        """
        self._linger_ms = int(timeout * 1000)
        self._closing = True
        self._sleeping = True
        self.kick()
        _LINGERING[self.requested_endpoint] = self
        if not self._flushed.wait(timeout):
            self._abort = True
            self.ring.close()
            self._flushed.wait(5)
            return False
        return True

    # --- publisher thread ------------------------------------------------------------
    def _main(self) -> None:
        ctx = zmq.Context(io_threads=1)
        if self.background and hasattr(os, "setpriority"):
            # Lowest CFS weight (nice 19) for this thread only: it still always runs, but it
            # rarely preempts the model's OpenMP threads, whose barrier would otherwise stall
            # for the whole time slice. (SCHED_IDLE was not used: it can starve forever.)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
        sock = ctx.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            if self.curve_secret_key is not None:
                sock.curve_secretkey = self.curve_secret_key
                sock.curve_server = True
            sock.bind(self.requested_endpoint)
            self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException as exc:  # surfaced to attach() in the caller's thread
            self._error = exc
            sock.close(0)
            ctx.term()
            os.close(self._rfd)
            os.close(self._wfd)
            self._wfd = -1
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(sock)
            self._flushed.set()
            self._end_of_stream(sock)
        finally:
            self._flushed.set()
            sock.close(self._linger_ms if not self._abort else 0)
            ctx.term()
            wfd, self._wfd = self._wfd, -1
            os.close(wfd)
            os.close(self._rfd)

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._rfd, zmq.POLLIN)
        pending: deque[zmq.MessageTracker | None] = deque()
        queue = self.queue
        while not self._abort:
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._read_subscriptions(sock)
            if queue:
                self._send(sock, queue.popleft(), pending)
                self._release_done(pending)
                continue
            self._release_done(pending)
            if self._closing:
                break
            self._sleeping = True
            if queue:  # raced with a producer that saw us awake
                self._sleeping = False
                continue
            poller.poll(1 if pending else 1000)
            self._sleeping = False
            try:
                os.read(self._rfd, 4096)
            except BlockingIOError:
                pass
        # Flushing: zero-copy frames must stay valid until ZeroMQ has sent them.
        deadline = time.monotonic() + self._linger_ms / 1000
        while pending and not self._abort and time.monotonic() < deadline:
            self._release_done(pending)
            time.sleep(0.001)

    def _end_of_stream(self, sock: zmq.Socket) -> None:
        """Tell each subscriber the stream ended; wait until they all acknowledge or leave."""
        deadline = time.monotonic() + self._linger_ms / 1000
        for presence in list(self.subscribers):
            while not self._abort and time.monotonic() < deadline:
                try:
                    sock.send_multipart([presence, END_OF_STREAM], zmq.NOBLOCK)
                    break
                except zmq.Again:
                    time.sleep(0.002)
        # A subscriber acknowledges by dropping its presence topic after reading the end.
        while self.subscribers and not self._abort and time.monotonic() < deadline:
            if sock.poll(50, zmq.POLLIN):
                self._read_subscriptions(sock)

    def _read_subscriptions(self, sock: zmq.Socket) -> None:
        while True:
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[1:].startswith(PRESENCE):
                with self._sub_cond:
                    (self.subscribers.add if msg[:1] == b"\x01" else self.subscribers.discard)(msg[1:])
                    self._sub_cond.notify_all()

    def _send(self, sock: zmq.Socket, item: Staged, pending: deque) -> None:
        if not item.topic:  # tombstone: a slot whose copy failed; just free it in order
            pending.append(None)
            return
        if item.event is not None:
            item.event.synchronize()  # the device-to-host copy has landed
        data = item.data
        big = data.nbytes >= ZERO_COPY_MIN
        envelope = encode_envelope(self.run, item.topic, item.phase, item.dtype, item.step, item.layer, item.hidden,
                                   item.tokens.data, b"" if big else data.data)
        tracker = None
        if self._send_first(sock, envelope, big):
            if big:
                if item.in_ring:  # the ring slot is reused only once ZeroMQ is done with it
                    tracker = sock.send(data, copy=False, track=True)
                else:
                    sock.send(data, copy=False)
            self.published += 1
            self.bytes += data.nbytes
        else:
            self.dropped += 1
        if item.in_ring:
            pending.append(tracker)

    def _send_first(self, sock: zmq.Socket, frame: bytes, more: bool) -> bool:
        """Send frame 0; False if best_effort had to drop (or we are aborting)."""
        flags = zmq.NOBLOCK | (zmq.SNDMORE if more else 0)
        delay = 0.0002
        while True:
            try:
                sock.send(frame, flags)
                return True
            except zmq.Again:
                if not self.complete or self._abort:
                    return False
                time.sleep(delay)  # back-pressure from a slow subscriber
                delay = min(delay * 2, 0.005)

    def _release_done(self, pending: deque) -> None:
        while pending and (pending[0] is None or pending[0].done):
            pending.popleft()
            self.ring.release_oldest()
