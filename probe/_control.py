"""The publisher's control thread: subscriptions while the model idles, held steps, the end of stream.

    class Publisher(HeldBundles, ControlThread): ...   # `_publisher.py`
    pub.close(end_body, timeout=30.0)     # the thread sends the end of stream, lingers for acknowledgements
    pub.join(timeout)                     # True once the socket is closed
    wait_lingering(endpoint)              # before binding again: our own closed socket may still hold it

A thread that sleeps `_IDLE_S` at a time reads subscription messages only while the model
is idle (the model's thread reads them itself at step boundaries, at most every
`SERVICE_EVERY_S`), sends held bundles once they are a linger old (`_linger.py`), and after
`close()` sends the end of stream and keeps the socket open until every subscriber has
acknowledged it. It runs on `io_cpus` when given.

A mixin of `Publisher`, which owns the socket, the lock, `_service` and the held bundles.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable

import zmq

from ._wire import END_TOPIC, encode_control

SERVICE_EVERY_S = 0.1  # the model's thread looks for new subscriptions at most this often (a look: docs/design.md)
_IDLE_S = 0.05  # the control thread's tick (it stays away while the model stepped within 2 x SERVICE_EVERY_S)

# Closed publishers whose sockets still wait for end-of-stream acknowledgements, by endpoint.
_LINGERING: weakref.WeakValueDictionary[str, ControlThread] = weakref.WeakValueDictionary()


@atexit.register
def _finish_lingering() -> None:
    """Let closed sockets finish their end of stream before the interpreter kills daemon threads
    (killing one inside libzmq aborts the process with "terminate called without an active exception")."""
    for pub in list(_LINGERING.values()):
        pub._thread.join(max(0.0, pub._deadline - time.monotonic()) if pub.complete else 2.0)


def wait_lingering(endpoint: str) -> None:
    """Wait while our own closed socket may still hold `endpoint` for its end of stream."""
    old = _LINGERING.get(endpoint)
    if old is not None:
        old._thread.join(max(0.0, old._deadline - time.monotonic()))


class ControlThread:
    # Publisher's: the socket and its context, the lock, `_service` (under the lock), the counts and subscribers,
    # `io_cpus`, `complete`; HeldBundles': `_held`, `_order`, `flush_held`. Set in Publisher.__init__ too:
    _thread: threading.Thread  # runs `_control`
    _closing: threading.Event
    _giving_up: threading.Event
    _end_body: dict
    _deadline: float
    idle_packer: Callable[[], None] | None

    # --- closing ---------------------------------------------------------------------------------
    def close(self, end_body: dict, timeout: float) -> None:
        """End the stream: the control thread sends `end_body` and lingers up to `timeout` s for acks."""
        if self._closing.is_set():
            return
        self.flush_held()  # before the counts: the end of stream follows everything published
        self._end_body = {**end_body, "endpoint": self.endpoint,
                          "counts": {k.decode(): v for k, v in self.counts.items()}}
        self._deadline = time.monotonic() + timeout
        _LINGERING[self.endpoint] = self
        self._giving_up.set()
        self._closing.set()
        # A held send in flight (the control thread's, waiting on a full pipe under `complete`) gives up now and
        # counts what it could not send as dropped: wait for that (milliseconds), so the counts are final here.
        with self._order:
            pass

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the end of stream to be acknowledged (or given up); True when the socket is closed."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _control(self) -> None:
        if self.io_cpus:
            try:
                os.sched_setaffinity(0, self.io_cpus)  # 0 is this thread here
            except OSError:  # the cores went away (cpuset changed): stay where we are
                pass
        try:
            while not self._closing.wait(_IDLE_S):
                packer = self.idle_packer
                if packer is not None:
                    packer()  # steps a linger old that wait unpacked: into held bundles, sent just below
                if self._held and time.monotonic() - self._held_since >= self._linger:
                    self.flush_held(blocking=False)  # the model stopped stepping (or steps slowly): send them
                if time.monotonic() - self.last_active < 2 * SERVICE_EVERY_S:
                    continue  # the model's thread is stepping and reads subscriptions itself
                if self.lock.acquire(blocking=False):
                    try:
                        self._service()
                    finally:
                        self.lock.release()
            self._end_of_stream()
        finally:
            with self.lock:
                self.sock.close(0)
            self._stop_auth()
            self._ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:  # its ZAP socket lives on our context: before term()
            self._auth.stop()
            self._auth = None

    def _end_of_stream(self) -> None:
        """Broadcast the end until every subscriber acknowledged (dropped its presence topic) or time ran out.

        Re-sent every half second: under best_effort a subscriber with a full pipe
        loses it like any other message, and gets the next copy once it has read.
        """
        frame = encode_control(END_TOPIC, self._end_body)
        next_send = 0.0
        with self.lock:
            self._service()
            # Only those present at close are waited for: one that joins while the end is being repeated gets it
            # too and leaves, but a client that reconnects in a loop would otherwise keep the socket open forever.
            waiting = set(self.subscribers)
        while time.monotonic() < self._deadline:
            with self.lock:
                self._service()
                if not waiting & self.subscribers:
                    return
                if time.monotonic() >= next_send:
                    try:
                        self.sock.send(frame, zmq.NOBLOCK)
                        next_send = time.monotonic() + 0.5
                    except zmq.Again:
                        next_send = time.monotonic() + 0.005
            time.sleep(0.005)
