"""The copy path: valid rows of one activation -> one message handed to ZeroMQ.

    path = CopyPath(publisher, run=b"r1", capacity=64 << 20, cuda_device=None)
    path.capture(key, tensor, identity)        # from a hook, on the model's thread
    path.flush_device(block=True)              # CUDA: send what the device has copied

On CPU, small captures (< 64 KiB) are appended to the step's bundle (header, token ids
and rows) and ZeroMQ copies the bundle once more into its own message at the step's end:
memcpys of a few KiB, no tracker. The common one (every row real, contiguous) is *held*:
its bytes are copied into an arena at once, the model may overwrite them, and the rest
of its work (shape, identity rows, header) waits for the step's end, where it runs as
one loop. Between a model's layers every Python operation runs from cold caches, so
fewer of them in the hook is what counts, not fewer instructions. Large captures of
256 KiB or more with every row are sent from the model's tensor itself (`_borrow.py`); other large
captures are copied once into the staging ring, behind their header and tokens, and the
whole slot is sent zero-copy as one frame at the step's end, with the step's other sends (one
wake-up of ZeroMQ's I/O thread per step, not one per layer); a ring slot is reused only once ZeroMQ has
freed its message (a weak reference to the slot's array view dies then). Copies are
single-threaded (a memmove for every row of a contiguous tensor, numpy for rows picked out of
padding): torch's `copy_` runs in the intra-op OpenMP pool, and an
OpenMP region waiting on a core that a subscriber holds cost hundreds of times the copy
(see docs/design.md, "Costs behind the code").

On CUDA the copies are queued in the model's stream and sent once they have landed
(`_device_copy.py`). A step's small captures that wait for its end are packed there in
one loop (`_held.py`, a mixin of `CopyPath`).

Memory: staged payloads stay within `capacity` bytes; a capture larger than the whole
ring is sent alone from a one-off buffer under `complete` (the hook waits for ZeroMQ to
finish with it) and dropped under `best_effort`. Small messages queued inside ZeroMQ
are bounded by its high-water mark (SNDHWM x 64 KiB); a step's small captures wait in
this process until the step ends (under 64 KiB each, one per site).
"""

from __future__ import annotations

import ctypes
import time
import warnings

import numpy as np
import torch

from ._borrow import BorrowedCaptures
from ._bundle import Bundler
from ._device_copy import DeviceCopies
from ._held import HeldCaptures
from ._host import dtype_info, host_bytes, host_rows
from ._identity import StepIdentity
from ._pending import PendingSteps
from ._publisher import ZERO_COPY_MIN, Publisher
from ._sites import SiteKey
from ._staging import ALIGN, StagingRing
from ._wire import MAGIC, VERSION, PerSite, encode_envelope, head_struct

_memmove = ctypes.memmove


class CopyPath(PendingSteps, HeldCaptures, BorrowedCaptures):
    def __init__(self, publisher: Publisher, *, run: bytes, capacity: int, cuda_device: torch.device | None,
                 borrow: bool = False) -> None:
        self.pub = publisher
        self._init_borrow(borrow)  # large captures sent from the model's own tensor (`_borrow.py`)
        self.run = run
        self.ring = StagingRing(capacity, pinned=cuda_device is not None)
        self._ring_at = self.ring.array.ctypes.data  # the ring's address: large captures are memmoved into it
        self.captured = 0
        self.dropped = 0  # dropped here: no ring space under best_effort, or a failed copy
        self._cuda_device = cuda_device
        self._device = None if cuda_device is None else DeviceCopies(cuda_device)
        self._seq: dict[bytes, int] = {}  # per site: captures staged so far (the next one's seq)
        self._bundler = Bundler(run, self._seq)  # the step's small captures
        self._head = PerSite(lambda topic: head_struct(len(topic), len(run)))  # a site's large captures' frame start
        self._warned: set[str] = set()
        self._large: list[tuple[bytes, np.ndarray, int, int, int]] = []  # the step's staged large captures
        # The common small capture (every row real, contiguous, on the host) copies its bytes into the arena at
        # once and is packed into the bundle at the step's end (`_held.py`): see `capture`.
        self._init_arena()
        self._init_pending()  # decode steps packed many at a time (`_pending.py`)

    def capture(self, key: SiteKey, t: torch.Tensor, ident: StepIdentity, *, hold: bool = True) -> None:
        """Stage one capture. One that fails is counted (captured and dropped) here, and its exception raised
        for the caller to report: the counts stay exact even when held captures were packed on the way.

        `hold=False` at a step's end (the hooks deferred the step's captures): a small capture goes straight
        into the bundle, with no copy into the arena first."""
        before = self.captured
        try:
            # The common case (a decode step's capture: every row real, contiguous, on the host, under 64 KiB)
            # copies its bytes now, because the model may overwrite them (vLLM's C kernel adds the residual in place),
            # and leaves everything else to the step's end. Between a model's layers every Python operation runs
            # from cold caches, so this path does the least it can and the step's end packs in one loop (its cost
            # against the general path's: docs/design.md, "Costs behind the code").
            if hold and ident.valid is None and t.is_cpu and t.is_contiguous():
                nbytes = t.nbytes
                used = self._arena_used
                if nbytes < ZERO_COPY_MIN:
                    if used + nbytes <= self._arena_size:
                        _memmove(self._arena_at + used, t.data_ptr(), nbytes)
                        self._arena_used = used + nbytes
                        self._held.append((key, t, ident, used, nbytes))  # shape, dtype: read at the step's end
                        return
                    self._arena_short = True
            with self.lock:
                if self._pending:
                    self._pack_pending()  # in order: earlier steps' captures go into the bundle first
                if self._held:
                    self._pack_held()  # in order: the held captures go into the bundle before this one
                before = self.captured
                self._capture_now(key, t, ident)
        except Exception:
            self.captured = before + 1
            self.dropped += 1
            raise

    def _capture_now(self, key: SiteKey, t: torch.Tensor, ident: StepIdentity) -> None:
        shape = t.shape
        if len(shape) != 3:
            t = t.reshape(ident.batch, -1, shape[-1])
            shape = t.shape
        batch, seq_len, hidden = shape
        index, tokens, n = ident.rows(seq_len)
        if n == 0:
            return
        dtype, itemsize = dtype_info(t.dtype)
        self.captured += 1
        nbytes = n * hidden * itemsize
        if t.is_cuda:
            off, data = self._slot(nbytes)
            if data is None:
                self.dropped += 1
                return
            if self._device is None:  # a CUDA activation of a model whose first parameter is on the host
                self._device = DeviceCopies(t.device)
            self._device.capture(key, t, ident, index, tokens, n, dtype, off, data)
            return
        if nbytes < ZERO_COPY_MIN:  # copied into the step's bundle; sent with the step's others at its end
            if index is None and t.is_cpu and t.is_contiguous():
                data = host_bytes(t.data_ptr(), nbytes)  # every row: the tensor's own bytes, no numpy view
            else:
                rows = host_rows(t)
                if index is not None:
                    rows = rows.reshape(batch * seq_len, -1).take(index, axis=0)
                data = np.ascontiguousarray(rows).data
            self._bundler.entry(key, ident, dtype, hidden, n, tokens, data, nbytes, time.time_ns())
            return
        topic = key.topic
        if self._try_borrow(key, t, ident, index, dtype, hidden, tokens, nbytes):
            return
        head = self._head[topic]
        lead = head.size + len(tokens)  # frame 0 up to the payload
        pad = -lead % ALIGN  # the payload starts 64-byte aligned in the ring: a faster copy into it
        off, slot = self._slot(pad + lead + nbytes)
        if slot is None:
            self.dropped += 1
            return
        if off is None:  # larger than the ring: the two-frame path, which waits for its one-off buffer
            data = slot[:nbytes]
            self._copy_rows(host_rows(t).reshape(batch * seq_len, -1), index, data, n)
            self._send_staged(key, ident.step, ident.phase, dtype, hidden, tokens, None, data)
            return
        try:
            at = self._ring_at + off + pad  # the frame's address in the ring
            if index is None and nbytes == t.nbytes and t.is_contiguous():
                # Every row, contiguous: one memmove from the tensor's own bytes. Between a model's layers each
                # numpy call runs from cold caches, and the views cost a third of the capture (docs/design.md,
                # "Costs behind the code", Copies).
                _memmove(at + lead, t.data_ptr(), nbytes)
            else:
                self._copy_rows(host_rows(t).reshape(batch * seq_len, -1), index, slot[pad + lead :], n)
            if self._held or self._bundler.queued:
                self.flush()  # in order: the step's small captures before this one
            seq = self._seq.get(topic, 0)
            self._seq[topic] = seq + 1
            # The whole capture is one frame read in place by ZeroMQ: header and tokens written just before
            # the rows. A separate header frame cost the sender a send and the subscriber a receive and a small
            # allocation between large ones (3 MiB captures: 83-103 page faults per message at a raw
            # receiver, against 19-30 as one frame).
            head.pack_into(slot, pad, topic, MAGIC, VERSION, ident.phase, dtype, ident.step, key.layer, hidden, n,
                           len(self.run), len(topic), seq, time.time_ns(), self.run)
            _memmove(at + head.size, tokens, len(tokens))
        except BaseException:
            self.ring.release(off)  # the ring frees in order: a slot left staged would block it for good
            raise
        # Sent at the step's end with the step's others (`_send_large`): each send that finds ZeroMQ's I/O thread
        # asleep wakes it on another core, and a prefill's layers are far enough apart for it to fall asleep
        # between them (see docs/design.md, "Costs behind the code", Waking ZeroMQ's I/O thread).
        self._large.append((topic, slot[pad:], nbytes, seq, off))

    def _send_large(self) -> None:
        """Send the step's large captures, staged in the ring, in order (after any bundles held from earlier
        steps); every slot is released, sent or not."""
        large, self._large = self._large, []
        pub, ring = self.pub, self.ring
        if pub.held:
            pub.send_bundles([])  # earlier steps' held bundles go first
        try:
            while large:
                topic, frame, nbytes, seq, off = large[0]
                if off < 0:  # borrowed: the header frame, then the tensor's own bytes
                    self._send_borrowed(topic, frame, nbytes, seq)
                else:
                    held = pub.send(topic, None, frame, nbytes=nbytes, seq=seq)
                    ring.release(off, None if held is False else held)
                large.pop(0)
        finally:
            for item in large:  # a send raised: the rest were not handed over
                if item[4] < 0:
                    self._unsend_borrowed(item[2])
                else:
                    ring.release(item[4])
                self.dropped += 1

    @staticmethod
    def _copy_rows(rows: np.ndarray, index: np.ndarray | None, dst: np.ndarray, n: int) -> None:
        dst = dst.view(rows.dtype).reshape(n, -1)
        if index is None:
            np.copyto(dst, rows)
        else:
            np.take(rows, index, axis=0, out=dst)

    def flush(self, *, hold: bool = False) -> None:
        """Hand the step's small captures to ZeroMQ in one burst (`hold`: at the step's end, where the publisher
        may keep them for a later step's burst; see `Publisher.send_bundles`).

        Each send that finds ZeroMQ's I/O thread asleep wakes it on another core, which costs
        far more than a send while it is awake. Sent as the layers finish, the 8 captures of a
        decode step woke it 8 times; in one burst, about once. Bundles that fill up mid-step
        (64 KiB: 4 captures of a batch-8 decode step at hidden 512) wait for the burst too:
        flushed where they filled, they woke the I/O thread mid-forward (see docs/design.md,
        "Costs behind the code").
        Decode steps that wait unpacked (`_pending.py`) are packed first, unless this is a step's end
        (`hold`) that held nothing of its own (`defer_step` has packed them if they were due).
        """
        with self.lock:
            if self._pending and (not hold or self._held):  # the held captures come after them
                self._pack_pending()
            if self._held:
                self._pack_held()
            if self._borrowed:
                self.return_borrowed()
            if self._large:  # staged before any of the bundler's captures (see `_capture_now`)
                self._send_large()
            bundles = self._bundler.take()
            if bundles or self.pub.held:
                self.pub.send_bundles(bundles, hold=hold, since=self.take_packed_since())

    def _slot(self, nbytes: int) -> tuple[int | None, np.ndarray | None]:
        """(ring offset or None for a one-off buffer, the bytes to fill); (None, None) to drop."""
        ring, pub = self.ring, self.pub
        if nbytes > ring.capacity:
            if self._large:  # the wait below is for the ring to empty: our own staged captures must leave first
                self._send_large()
            self._warn_once("oversize", f"probebus: a capture of {nbytes} bytes exceeds capacity_bytes="
                            f"{ring.capacity}; raise capacity_bytes (under best_effort such captures are dropped, "
                            "under complete each waits until the ring is empty and ZeroMQ has sent it)")
            if not pub.complete or pub.degraded:
                return None, None
            if ring.reclaim() and pub.backpressure(lambda: ring.reclaim() == 0) is not True:
                return None, None
            return None, np.empty(nbytes, dtype=np.uint8)

        def alloc() -> int | bool:
            off = ring.alloc(nbytes)
            return False if off is None else off

        off = alloc()
        if off is False and self._large:  # the step's own staged captures hold the ring: send them, try again
            self._send_large()
            off = alloc()
        if off is False:
            off = pub.backpressure(alloc)
            if off is False:
                return None, None
        return int(off), ring.bytes_at(int(off), nbytes)

    def _send_staged(self, key: SiteKey, step: int, phase: int, dtype: int, hidden: int, tokens: bytes,
                     off: int | None, data: np.ndarray) -> None:
        pub = self.pub
        self.flush()  # in order: the step's small captures before this one
        seq = self._seq.get(key.topic, 0)
        self._seq[key.topic] = seq + 1
        if data.nbytes < ZERO_COPY_MIN:  # CUDA path: small payloads travel inline, the slot frees at once
            frame = encode_envelope(self.run, key.topic, phase, dtype, step, key.layer, hidden, tokens, data.data,
                                    seq=seq, sent_ns=time.time_ns())
            pub.send(key.topic, frame, nbytes=data.nbytes, seq=seq)
            held = None
        else:
            env = encode_envelope(self.run, key.topic, phase, dtype, step, key.layer, hidden, tokens, seq=seq,
                                  sent_ns=time.time_ns())
            held = pub.send(key.topic, env, data, seq=seq, track=off is None)
        if held is False:
            held = None
        if off is not None:
            self.ring.release(off, held)
        elif held is not None:  # a one-off buffer larger than the ring: memory stays bounded only if we wait
            pub.backpressure(lambda: held.done)

    def flush_device(self, block: bool) -> None:
        """Send the step's small captures; on CUDA also the device copies that have landed (all when `block`)."""
        self.flush(hold=not block)
        if self._device is None:
            return
        for c in self._device.landed(block):
            if not c.failed:
                self._send_staged(c.key, c.step, c.phase, c.dtype, c.hidden, c.tokens, c.off, c.data)
            elif c.off is not None:  # nothing to send: the slot only waited for the step's event
                self.ring.release(c.off)

    @property
    def queued(self) -> int:
        device = 0 if self._device is None else self._device.queued
        return device + self.pending + len(self._held) + len(self._large) + self._bundler.queued + self.pub.held

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=5)
