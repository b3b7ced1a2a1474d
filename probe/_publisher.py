"""The socket side of a session: sends from the hook, tracks subscribers, ends the stream.

    pub = Publisher("ipc:///tmp/x/bus", run="r1", policy="complete", sndhwm=1024,
                    curve_secret_key=None, stall_timeout=30.0)
    pub.send_bundle(bundle, [(site, nbytes, seq), ...])  # a step's small captures: one message when it may
    pub.send_bundles([(bundle, meta), ...], hold=True)  # the same at a step's end, held for later steps' send
    held = pub.send(site, envelope, payload)      # big capture: envelope + zero-copy payload
    held() is None                                # ZeroMQ is done with the payload's memory
    pub.set_info(build_info)                      # a dict, or a function called only when an info goes out
    pub.send_control(encode_control(topic, body), hold=True)  # in order with the held bundles
    pub.close(end_body, timeout=30.0)             # end of stream in the background

There is no publisher thread: the model's thread hands each capture to ZeroMQ itself,
whose I/O thread (C++, no GIL) does the rest asynchronously. A Python publisher thread
cost the model more than that even with no subscriber: its encode-and-send loop held the
GIL while the model's thread came back from every torch op (see docs/design.md, "Costs behind the code").

Policies map onto the socket. `complete` sets XPUB_NODROP: a full pipe makes the send
fail with EAGAIN and the hook waits (back-pressure reaches the model) for at most
`stall_timeout` seconds, then the session degrades: NODROP goes off, so the stalled
subscriber loses messages while every other subscriber keeps getting all of them,
and each subscriber sees its own losses as sequence gaps (`SubscriberStats.missed`).
`best_effort` never sets NODROP: ZeroMQ drops per subscriber at its high-water mark
and never blocks, so one slow subscriber cannot starve the others.

A step's small captures go out as one bundle (`_wire.py`) while no subscriber filters by
site, else one message each so that ZeroMQ's per-site filtering keeps working.

Unless a subscriber is *live*, a step's bundles are held for a later send (`_linger.py`).

Subscribers announce themselves with a private presence topic (counted by
`wait_for_subscribers`); each new one triggers the session-info broadcast. The model's
thread reads subscription messages at step boundaries; the control thread (`_control.py`)
does it only while the model is idle, and after `close()` sends the end of stream and
keeps the socket open until every subscriber has acknowledged it.

`io_cpus` places ZeroMQ's I/O thread and the control thread on those cores. A process
pinned to the model's cores (a vLLM CPU worker binds itself and every thread it starts
to its OpenMP cores) would otherwise run them on the model's core, between its ops.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import zmq

from ._control import SERVICE_EVERY_S, ControlThread, wait_lingering
from ._curve import admit_only
from ._decode import capture_frames
from ._linger import MAX_DELAY_S, HeldBundles
from ._placement import usable_cpus
from ._wire import END_TOPIC, INFO_TOPIC, LIVE_PRESENCE, PRESENCE, encode_control

# Plain ints: zmq's flags are IntFlag enums, and `|` on them costs dispatch on the hot path (docs/design.md).
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
ZERO_COPY_MIN = 1 << 16  # below this a memcpy into ZeroMQ's message beats a tracker (docs/design.md, Sending)
_UNFILTERED = {b"", INFO_TOPIC, END_TOPIC}  # subscriptions of subscribers that take every site
Frame = bytes | bytearray | memoryview


class Publisher(HeldBundles, ControlThread):
    def __init__(self, endpoint: str, *, run: str, policy: str, sndhwm: int, curve_secret_key: bytes | None,
                 stall_timeout: float | None, io_cpus: set[int] | None = None,
                 max_delay: float = MAX_DELAY_S, curve_clients: set[bytes] | None = None) -> None:
        wait_lingering(endpoint)  # our own closed socket may still hold this address for its end of stream
        self.complete = policy == "complete"
        self.stall_timeout = stall_timeout
        self.lock = threading.Lock()
        self.published = 0
        self.dropped = 0  # refused by a full pipe after the stall limit, or while closing
        self.bytes = 0
        self.counts: dict[bytes, int] = {}  # per site: the seq after the last published capture
        self.subscribers: set[bytes] = set()
        self.topics: set[bytes] = set()  # distinct subscribed prefixes, presence topics aside
        self.bundling = True  # no subscriber filters by site: a step's small captures go as one message
        self.live = False  # a live subscriber is present: every step's bundles go at its end
        self._init_held(max_delay)
        self.idle_packer: Callable[[], None] | None = None  # the copy path's steps waiting unpacked (`_pending.py`)
        self.degraded = False
        self.last_active = 0.0
        self.info_body: dict | Callable[[], dict] = {}  # or a function: built only when an info is sent
        self._controls: list[bytes] = []  # control messages a full pipe refused: sent again at later steps
        self._stall_s = 0.0
        self._stall_since: float | None = None
        self._info_due = False
        self._closing = threading.Event()
        self._giving_up = threading.Event()  # waits on full pipes end now (`give_up`), the session closing
        self._end_body: dict = {}
        self._deadline = float("inf")
        self.io_cpus = usable_cpus(io_cpus)
        self._ctx = zmq.Context(io_threads=1)
        for cpu in sorted(self.io_cpus or ()):  # before the first socket: libzmq starts its I/O thread there
            self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        sock = self._ctx.socket(zmq.XPUB)
        self._auth = None  # CURVE's ZAP handler when only some clients may read (`_curve.py`)
        try:
            sock.setsockopt(zmq.XPUB_NODROP, 1 if self.complete else 0)
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            if curve_secret_key is not None:
                if curve_clients is not None:
                    self._auth = admit_only(self._ctx, curve_clients)
                sock.curve_secretkey = curve_secret_key
                sock.curve_server = True
            sock.bind(endpoint)
        except BaseException:
            sock.close(0)
            self._stop_auth()
            self._ctx.term()
            raise
        self.sock = sock
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._thread = threading.Thread(target=self._control, name="probebus-control", daemon=True)
        self._thread.start()

    # --- the model's thread ----------------------------------------------------------------
    def send_bundle(self, bundle: bytearray, meta: Sequence[tuple[bytes, int, int]]) -> None:
        """Send a step's small captures: `bundle` (BUNDLE_TOPIC + length-prefixed frames) as one message
        while nobody filters by site, else each frame alone; `meta` is (topic, payload bytes, seq) per frame."""
        if self.bundling and len(meta) > 1:
            with self.lock:
                try:
                    sent = self._send_locked(bundle, None)
                except zmq.ZMQError:  # closed under us (close from another thread)
                    sent = False
            if sent is False and not self._giving_up.is_set():
                sent = self._wait_send(bundle, None)
            if sent is False:
                self.dropped += len(meta)
                return
            counts, total = self.counts, 0
            for site, nbytes, seq in meta:  # `_sent` inlined: a call per capture runs from cold caches
                counts[site] = seq + 1
                total += nbytes
            self.published += len(meta)
            self.bytes += total
            return
        entries = capture_frames(memoryview(bundle))  # groups expanded: one frame 0 per capture
        self._send_each([(site, e, nbytes, seq) for (site, nbytes, seq), e in zip(meta, entries, strict=True)])

    def _send_each(self, frames: list[tuple[bytes, memoryview, int, int]]) -> None:
        """One message per capture, in order, holding the lock once while the pipe takes them."""
        lock, sock = self.lock, self.sock
        i, n = 0, len(frames)
        while i < n:
            with lock:
                try:
                    while i < n:
                        site, frame, nbytes, seq = frames[i]
                        sock.send(frame, _NOBLOCK)
                        self._sent(site, seq, nbytes)
                        i += 1
                except zmq.Again:
                    pass
                except zmq.ZMQError:  # closed under us (close from another thread)
                    self.dropped += n - i
                    return
            if i < n:  # a full pipe: this one waits (complete) or is dropped, then the rest go on
                site, frame, nbytes, seq = frames[i]
                self.send(site, frame, nbytes=nbytes, seq=seq)
                i += 1

    def _sent(self, site: bytes, seq: int, nbytes: int) -> None:
        self.counts[site] = seq + 1
        self.published += 1
        self.bytes += nbytes

    def send(self, site: bytes, frame0: Frame | None, payload: np.ndarray | None = None, nbytes: int = 0,
             seq: int = 0, track: bool = False) -> object:
        """Hand one capture to ZeroMQ: False if dropped, else a weak reference to the payload that dies
        when ZeroMQ is done with its memory (None when the payload travels inline in `frame0`; with `track`,
        a MessageTracker instead, for a caller that still holds the payload while it waits). `frame0` None:
        `payload` is the whole capture, header included, sent as one frame without a copy.

        `nbytes`: the activation bytes inside `frame0` when there is no separate payload (for stats)."""
        with self.lock:
            try:
                sent = self._send_locked(frame0, payload, track)
            except zmq.ZMQError:  # closed under us (close from another thread)
                sent = False
        if sent is False and not self._giving_up.is_set():
            sent = self._wait_send(frame0, payload, track)
        if sent is False:
            self.dropped += 1
            return False
        self._sent(site, seq, nbytes if payload is None or frame0 is None else payload.nbytes)
        return sent

    def _send_locked(self, frame0: Frame | None, payload: np.ndarray | None, track: bool = False) -> object:
        """One message, both frames under one hold of the lock: False on EAGAIN, else a weakref or None.

        `frame0` None: `payload` alone is the message (a whole capture staged in the ring), zero-copy."""
        sock = self.sock
        flags = 0
        if frame0 is not None:
            try:
                sock.send(frame0, _NOBLOCK | _SNDMORE if payload is not None else _NOBLOCK)
            except zmq.Again:
                return False
            if payload is None:
                return None
        else:
            flags = _NOBLOCK
        # Later parts of a message never fail: NODROP checks the high-water mark on the first only.
        try:
            if track:
                return sock.send(payload, flags, copy=False, track=True)
            # No MessageTracker (it builds a threading.Event per send): pyzmq holds `payload` until ZeroMQ
            # frees the message, so a weak reference to this one-off array view dies exactly then.
            sock.send(payload, flags, copy=False)
        except zmq.Again:  # only a single-frame message can get here
            return False
        return weakref.ref(payload)

    def _wait_send(self, frame0: Frame | None, payload: np.ndarray | None, track: bool = False) -> object:
        def attempt() -> object:
            with self.lock:
                self._service()
                return self._send_locked(frame0, payload, track)
        return self.backpressure(attempt)

    def backpressure(self, attempt: Callable[[], object]) -> object:
        """`complete`: retry `attempt()` (False = not yet) until it succeeds; False means drop.

        Gives up when the session closes, or degrades after `stall_timeout` seconds and
        tries once more. Under `best_effort` (or once degraded) it never waits.
        """
        if not self.complete or self.degraded:
            return False
        t0 = self._stall_since = time.monotonic()
        delay = 1e-4
        try:
            while not self._giving_up.is_set():
                time.sleep(delay)
                delay = min(delay * 2, 5e-3)
                if self.stall_timeout is not None and time.monotonic() - t0 > self.stall_timeout:
                    self.degrade()
                try:
                    got = attempt()
                except zmq.ZMQError:  # the socket was closed under us
                    return False
                if got is not False or self.degraded:
                    return got
            return False
        finally:
            self._stall_s += time.monotonic() - t0
            self._stall_since = None

    @property
    def stalled(self) -> bool:
        """A send is waiting on a full pipe now (`complete`)."""
        return self._stall_since is not None

    def give_up(self) -> None:
        """End every wait on a full pipe, now and from now on (what is not sent is dropped and counted): the
        session is closing, or a thread closing it must not wait behind a model's thread blocked on a subscriber
        that reads nothing (`_session.py`)."""
        self._giving_up.set()

    def degrade(self) -> None:
        """Stop blocking on full pipes (after `stall_timeout` under `complete`)."""
        if not self.degraded:
            self.degraded = True
            with self.lock:
                self.sock.setsockopt(zmq.XPUB_NODROP, 0)
            warnings.warn(f"probebus: a subscriber of {self.endpoint} read nothing for {self.stall_timeout}s; "
                          "policy 'complete' degraded to dropping at that subscriber (it counts its losses as "
                          "`missed`; session.stats.degraded is True)", stacklevel=4)

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Block until `ready()` (reading subscriptions meanwhile); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                self._service()
            if ready():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def step_done(self) -> None:
        """Called by the model's thread after every forward: read subscriptions if any arrived."""
        now = time.monotonic()
        if now - self.last_active < SERVICE_EVERY_S and not self._info_due and not self._controls:
            return
        self.last_active = now
        with self.lock:
            try:
                if self._info_due or self._controls or self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._service()
            except zmq.ZMQError:  # closed by close() from another thread while this forward ran
                pass

    @property
    def stall_seconds(self) -> float:
        since = self._stall_since
        return self._stall_s + (time.monotonic() - since if since is not None else 0.0)

    def set_info(self, body: dict | Callable[[], dict], *, send: bool = True) -> None:
        """The session's description, sent now (`send`) and to every subscriber that joins later. A function
        is called only when an info goes out: a vLLM worker's request map can hold 10,000 entries, megabytes
        of JSON whose encoding its steps must not pay each time a request starts (docs/design.md, "Costs
        behind the code")."""
        with self.lock:
            self.info_body = body
            self._info_due = self._info_due or send
            self._service()

    def send_control(self, frame: bytes, *, hold: bool = False) -> None:
        """A control message (`encode_control`) from the model's thread, after any still waiting: a full pipe
        under `complete` keeps it for a later step instead of stalling the model (under `best_effort` ZeroMQ
        drops it at a slow subscriber like any message). With `hold` (a step's end) it joins the held bundles
        when they are being held, and leaves with them, in order."""
        if hold and self.hold_control(frame):
            return
        with self._order:
            if self._held:
                self._send_held()
            self._queue_control(frame)

    def _queue_control(self, frame: bytes) -> None:
        with self.lock:
            self._controls.append(frame)
            self._send_controls()

    # --- under the lock ------------------------------------------------------------------------
    def _service(self) -> None:
        sock = self.sock
        while True:
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                return
            topic, added = msg[1:], msg[:1] == b"\x01"
            if topic.startswith(PRESENCE):
                if added:
                    self.subscribers.add(topic)
                    self._info_due = True
                else:
                    self.subscribers.discard(topic)
                self.live = any(t.startswith(LIVE_PRESENCE) for t in self.subscribers)
            else:  # read before the presence that follows them: the info goes out with the right mode
                if added:
                    self.topics.add(topic)
                else:
                    self.topics.discard(topic)
                self.bundling = self.topics <= _UNFILTERED
        self._send_controls()
        if self._info_due and self.info_body:
            try:
                info = self.info_body() if callable(self.info_body) else self.info_body
                # With the per-site counts so far: a late joiner starts counting losses from there.
                body = {**info, "counts": {k.decode(): v for k, v in self.counts.items()}}
                sock.send(encode_control(INFO_TOPIC, body), zmq.NOBLOCK)
                self._info_due = False
            except zmq.Again:
                pass  # a full pipe under NODROP: try again at the next step or tick
            except Exception as exc:  # the info function failed: the session goes on, it is tried again later
                warnings.warn(f"probebus: could not build the session info: {exc!r}", stacklevel=2)

    def _send_controls(self) -> None:
        """Send the waiting control messages, in order, until the pipe is full (under the lock)."""
        controls = self._controls
        try:
            while controls:
                self.sock.send(controls[0], zmq.NOBLOCK)
                del controls[0]
        except zmq.ZMQError:  # Again: a full pipe under NODROP (later); else closed under us
            pass





