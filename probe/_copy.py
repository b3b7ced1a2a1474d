"""The copy path: valid rows of one activation -> one message handed to ZeroMQ.

    path = CopyPath(publisher, run=b"r1", capacity=64 << 20, cuda=False)
    path.capture(key, tensor, identity)        # from a hook, on the model's thread
    path.flush_device(block=True)              # CUDA: send what the device has copied

On CPU, small captures (< 64 KiB) are appended to the step's bundle (header, token ids
and rows) and ZeroMQ copies the bundle once more into its own message at the step's end:
memcpys of a few KiB, no tracker. The common one (every row real, contiguous) is *held*:
its bytes are copied into an arena at once, the model may overwrite them, and the rest
of its work (shape, identity rows, header) waits for the step's end, where it runs as
one loop. Between a model's layers every Python operation runs from cold caches, so
fewer of them in the hook is what counts, not fewer instructions. Large
captures are copied once into the staging ring, behind their header and tokens, and the
whole slot is sent zero-copy as one frame; a ring slot is reused only once ZeroMQ has
freed its message (a weak reference to the slot's array view dies then). Copies are
single-threaded numpy: torch's `copy_` runs in the intra-op OpenMP pool, and an
OpenMP region waiting on a core that a subscriber holds cost 7.8 ms instead of 13 us
for 384 KiB (measured on the 2-core machine).

On CUDA the rows are gathered on the device and copied non-blocking into the pinned
ring, in the model's own stream order; one event per step marks them, and they are
sent (a header frame, then the payload zero-copy) at a later step boundary once it has
completed, so the model's thread never waits for the copy. (A side stream with an
event per capture cost 6 CUDA calls per capture and measured +40 % on an H200 at batch
1: the host, not the GPU, is the bottleneck of a decode step there.)

Memory: staged payloads stay within `capacity` bytes; a capture larger than the whole
ring is sent alone from a one-off buffer under `complete` (the hook waits for ZeroMQ to
finish with it) and dropped under `best_effort`. Small messages queued inside ZeroMQ
are bounded by its high-water mark (SNDHWM x 64 KiB); a step's small captures wait in
this process until the step ends (under 64 KiB each, one per site).
"""

from __future__ import annotations

import ctypes
import math
import struct
import time
import warnings
from collections import deque
from typing import NamedTuple

import numpy as np
import torch

from ._bundle import Bundler, GroupError
from ._identity import StepIdentity
from ._publisher import ZERO_COPY_MIN, Publisher
from ._staging import ALIGN, StagingRing
from ._wire import DTYPE_CODE, MAGIC, VERSION, encode_envelope, head_struct

_DTYPE_INFO = {d: (c, d.itemsize) for d, c in DTYPE_CODE.items()}
_ARENA_START, _ARENA_MAX = 256 << 10, 16 << 20  # bytes of a step's held small captures (see `capture`)
_memmove = ctypes.memmove
_CHARS: dict[int, type] = {}  # nbytes -> ctypes char array type (bounded: small captures come in few sizes)


def _dtype_info(dt: torch.dtype) -> tuple[int, int]:
    """(wire dtype code, item size); TypeError for a dtype the wire has no code for."""
    got = _DTYPE_INFO.get(dt)
    if got is None:
        raise TypeError(f"dtype {dt} cannot be published")
    return got


def _chars(nbytes: int) -> type:
    """The ctypes type of `nbytes` raw bytes (cached: small captures come in few sizes)."""
    chars = _CHARS.get(nbytes)
    if chars is None:
        chars = ctypes.c_char * nbytes
        if len(_CHARS) < 256:
            _CHARS[nbytes] = chars
    return chars


def _host_bytes(address: int, nbytes: int) -> ctypes.Array:
    """The `nbytes` at `address` in this process as a buffer, for one copy while the tensor is alive.

    A numpy view of a tensor (`t.numpy()`) costs ~0.7 us per call, a tenth of a decode-step capture's whole
    hook; this ~0.3 us. Only for contiguous CPU tensors, whose bytes are exactly [data_ptr, +nbytes)."""
    return _chars(nbytes).from_address(address)


def _host_rows(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 as int16: numpy has no bf16, the bits move unchanged)."""
    src = t.detach() if t.requires_grad else t  # detach alone costs ~3 us per call
    if src.dtype == torch.bfloat16:
        src = src.view(torch.int16)
    return src.numpy()


class SiteKey(NamedTuple):
    name: str
    topic: bytes
    layer: int


class _DeviceCopy(NamedTuple):
    key: SiteKey
    step: int
    phase: int
    dtype: int
    hidden: int
    tokens: bytes
    off: int | None  # ring slot, or None for a one-off buffer
    data: np.ndarray
    failed: bool = False  # the capture failed: nothing to send, the slot only waits for the step's event


class CopyPath:
    def __init__(self, publisher: Publisher, *, run: bytes, capacity: int, cuda_device: torch.device | None) -> None:
        self.pub = publisher
        self.run = run
        self.ring = StagingRing(capacity, pinned=cuda_device is not None)
        self.captured = 0
        self.dropped = 0  # dropped here: no ring space under best_effort, or a failed copy
        self._cuda_device = cuda_device
        self._step_copies: list[_DeviceCopy] = []  # device copies of the running step, not yet marked
        self._device: deque[tuple[object, list[_DeviceCopy]]] = deque()  # (event after them, copies) per step
        self._seq: dict[bytes, int] = {}  # per site: captures staged so far (the next one's seq)
        self._bundler = Bundler(run, self._seq)  # the step's small captures
        self._head: dict[bytes, struct.Struct] = {}  # per site: the struct of its large captures' frame start
        self._warned: set[str] = set()
        # The common small capture (every row real, contiguous, on the host) copies its bytes here at once and
        # is packed into the bundle at the step's end (`_pack_held`): see `capture`.
        self._arena = np.empty(_ARENA_START, dtype=np.uint8)
        self._arena_at = self._arena.ctypes.data
        self._arena_size = _ARENA_START
        self._arena_used = 0
        self._arena_short = False  # a capture found it full this step: it grows at the step's end
        self._held: list[tuple[SiteKey, torch.Tensor, StepIdentity, int, int]] = []  # key, tensor, ident, at, bytes

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
            # from cold caches: ~5 us for a dict lookup that costs 0.07 warm. The general path cost 35-80 us per
            # capture inside a vLLM worker at batch 8; this one 11-16 us, and the step's end packs in one loop.
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
            if self._held:
                self._pack_held()  # in order: the held captures go into the bundle before this one
                before = self.captured
            self._capture_now(key, t, ident)
        except Exception:
            self.captured = before + 1
            self.dropped += 1
            raise

    def capture_deferred(self, items: list[tuple[SiteKey, torch.Tensor, int]],
                         ident: StepIdentity) -> list[tuple[SiteKey, Exception | None]]:
        """A step's deferred captures (site, tensor, its version at the hook), in hook order, at the step's end.

        Returns what failed: (site, exception), or (site, None) for a tensor written since its hook (dropped).
        Runs of the common capture (every row real, a host tensor of the step's rows, under 64 KiB, the same
        shape and dtype: a decode step's sites) go into the bundle as one group, one copy each; the checks
        run once per run. Anything else takes `capture`'s general path, in order."""
        failed: list[tuple[SiteKey, Exception | None]] = []
        sent_ns = time.time_ns()  # one stamp: they leave together
        last: tuple = ()
        fast: tuple | None = None
        run: list[tuple[SiteKey, object]] = []  # the current run of common captures, not yet in the bundle
        for key, t, version in items:
            before = self.captured
            try:
                if t._version != version:
                    self.captured += 1
                    self.dropped += 1
                    failed.append((key, None))
                    continue
                shape, dt = t.shape, t.dtype
                if last != (shape, dt):
                    if run:
                        self._group(ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
                        run = []
                    last, fast = (shape, dt), None
                    info = _DTYPE_INFO.get(dt)
                    if len(shape) == 3 and ident.valid is None and info is not None:
                        index, tokens, n = ident.rows(shape[1])
                        nbytes = n * shape[2] * info[1]
                        if index is None and n and nbytes < ZERO_COPY_MIN and nbytes == t.nbytes:
                            fast = (info[0], shape[2], n, tokens, nbytes)
                            at_address = _chars(nbytes).from_address
                if fast is not None and t.is_cpu and t.is_contiguous():
                    run.append((key, at_address(t.data_ptr())))  # the tensor's own bytes: copied once, into the bundle
                    continue
                if run:
                    self._group(ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
                    run = []
                self.capture(key, t, ident, hold=False)  # counts a failure itself
            except Exception as exc:  # the step's other captures still go out
                if self.captured == before:
                    self.captured = before + 1
                    self.dropped += 1
                failed.append((key, exc))
        if run:
            self._group(ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
        return failed

    def _group(self, ident: StepIdentity, fast: tuple[int, int, int, bytes, int], run: list[tuple[SiteKey, object]],
               sent_ns: int, failed: list[tuple[SiteKey, Exception | None]]) -> None:
        """Bundle a run of common captures as one group; counts them, and what a failure dropped."""
        dtype, hidden, n, tokens, nbytes = fast
        self.captured += len(run)
        try:
            self._bundler.group(ident, dtype, hidden, n, tokens, nbytes, run, sent_ns)
        except GroupError as exc:
            self.dropped += len(run) - exc.written
            failed.extend((key, exc.__cause__) for key, _ in run[exc.written:])  # type: ignore[misc]

    def _capture_now(self, key: SiteKey, t: torch.Tensor, ident: StepIdentity) -> None:
        shape = t.shape
        if len(shape) != 3:
            t = t.reshape(ident.batch, -1, shape[-1])
            shape = t.shape
        batch, seq_len, hidden = shape
        index, tokens, n = ident.rows(seq_len)
        if n == 0:
            return
        dtype, itemsize = _dtype_info(t.dtype)
        self.captured += 1
        nbytes = n * hidden * itemsize
        if t.is_cuda:
            self._capture_cuda(key, t, ident, index, tokens, n, dtype, nbytes)
            return
        if nbytes < ZERO_COPY_MIN:  # copied into the step's bundle; sent with the step's others at its end
            if index is None and t.is_cpu and t.is_contiguous():
                data = _host_bytes(t.data_ptr(), nbytes)  # every row: the tensor's own bytes, no numpy view
            else:
                rows = _host_rows(t)
                if index is not None:
                    rows = rows.reshape(batch * seq_len, -1).take(index, axis=0)
                data = np.ascontiguousarray(rows).data
            self._bundler.entry(key, ident, dtype, hidden, n, tokens, data, nbytes, time.time_ns())
            return
        rows = _host_rows(t).reshape(batch * seq_len, -1)
        topic = key.topic
        head = self._head.get(topic)
        if head is None:
            head = self._head[topic] = head_struct(len(topic), len(self.run))
        lead = head.size + len(tokens)  # frame 0 up to the payload
        pad = -lead % ALIGN  # the payload starts 64-byte aligned in the ring: a faster copy into it
        off, slot = self._slot(pad + lead + nbytes)
        if slot is None:
            self.dropped += 1
            return
        if off is None:  # larger than the ring: the two-frame path, which waits for its one-off buffer
            data = slot[:nbytes]
            self._copy_rows(rows, index, data, n)
            self._send_staged(key, ident.step, ident.phase, dtype, hidden, tokens, None, data)
            return
        try:
            self._copy_rows(rows, index, slot[pad + lead :], n)
            self.flush()  # in order: the step's small captures before this one
            seq = self._seq.get(topic, 0)
            self._seq[topic] = seq + 1
            # The whole capture is one frame read in place by ZeroMQ: header and tokens written just before
            # the rows. A separate header frame cost the sender a send and the subscriber a receive and a small
            # allocation between large ones (3 MiB captures: 83-103 page faults per message at a raw
            # receiver, against 19-30 as one frame).
            head.pack_into(slot, pad, topic, MAGIC, VERSION, ident.phase, dtype, ident.step, key.layer, hidden, n,
                           len(self.run), len(topic), seq, time.time_ns(), self.run)
            slot[pad + head.size : pad + lead] = np.frombuffer(tokens, dtype=np.uint8)
            held = self.pub.send(topic, None, slot[pad:], nbytes=nbytes, seq=seq)
        except BaseException:
            self.ring.release(off)  # the ring frees in order: a slot left staged would block it for good
            raise
        self.ring.release(off, None if held is False else held)

    def _pack_held(self) -> None:
        """Put the captures `capture` held (their bytes already in the arena) into the bundle, in order."""
        held, self._held = self._held, []
        arena = memoryview(self._arena)
        sent_ns = time.time_ns()  # one stamp: they leave together
        last: tuple = ()  # (ident, shape, dtype) of the capture before: a decode step's captures share them
        fast: tuple = ()
        run: list[tuple[SiteKey, object]] = []  # consecutive captures of one (ident, shape, dtype): one group
        run_ident = None
        failed: list[tuple[SiteKey, Exception | None]] = []
        for key, t, ident, at, nbytes in held:
            try:
                shape, dt = t.shape, t.dtype
                if last != (ident, shape, dt):
                    if run:
                        self._group(run_ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
                        run = []
                    last = (ident, shape, dt)
                    hidden = shape[-1]
                    # The rows `_capture_now` would see: it reshapes any other rank to [batch, -1, hidden].
                    seq_len = shape[1] if len(shape) == 3 else math.prod(shape) // (ident.batch * hidden)
                    index, tokens, n = ident.rows(seq_len)
                    dtype, itemsize = _dtype_info(dt)
                    fast, run_ident = (dtype, hidden, n, tokens, n * hidden * itemsize), ident
                    if n and index is not None:
                        raise ValueError(f"a {tuple(shape)} activation does not match the step's {ident.batch} rows")
                if n == 0:
                    continue
                if nbytes != fast[4]:
                    raise ValueError(f"a {tuple(shape)} activation does not match the step's {ident.batch} rows")
                run.append((key, arena[at : at + nbytes]))
            except Exception as exc:  # the step's other captures still go out
                last = ()
                self.captured += 1
                self.dropped += 1
                failed.append((key, exc))
        if run:
            self._group(run_ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
        for key, exc in failed:
            self._warn_once(repr(type(exc)), f"probebus: capture of {key.name} failed and was dropped: {exc!r}")
        self._arena_used = 0
        if self._arena_short:  # it ran out this step: twice the size from the next one (within a bound)
            self._arena_short = False
            if self._arena_size < _ARENA_MAX:
                self._arena = np.empty(min(2 * self._arena_size, _ARENA_MAX), dtype=np.uint8)
                self._arena_at, self._arena_size = self._arena.ctypes.data, len(self._arena)

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

        Each send that finds ZeroMQ's I/O thread asleep wakes it on another core: 60-96 us
        on the 2-core VM against ~5 us while it is awake. Sent as the layers finish, the
        8 captures of a decode step woke it 8 times; in one burst, about once. Bundles that
        fill up mid-step (64 KiB: 4 captures of a batch-8 decode step at hidden 512) wait
        for the burst too: flushed where they filled, they woke the I/O thread mid-forward
        (2.5 % of a vLLM worker's time at batch 8 under py-spy).
        """
        if self._held:
            self._pack_held()
        bundles = self._bundler.take()
        if bundles or self.pub.held:
            self.pub.send_bundles(bundles, hold=hold)

    def _slot(self, nbytes: int) -> tuple[int | None, np.ndarray | None]:
        """(ring offset or None for a one-off buffer, the bytes to fill); (None, None) to drop."""
        ring, pub = self.ring, self.pub
        if nbytes > ring.capacity:
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

    def _capture_cuda(self, key: SiteKey, t: torch.Tensor, ident: StepIdentity, index: np.ndarray | None,
                      tokens: bytes, n: int, dtype: int, nbytes: int) -> None:
        batch, seq_len, hidden = t.shape
        off, data = self._slot(nbytes)
        if data is None:
            self.dropped += 1
            return
        copy = _DeviceCopy(key, ident.step, ident.phase, dtype, hidden, tokens, off, data)
        try:
            self._device_rows(t, None if index is None else ident.device_index(seq_len), data, n)
        except BaseException:
            # The ring frees in order, so a slot left staged would block it for good; a copy may already be
            # queued into it, so it is freed at the step's event like the others, and never sent.
            self._step_copies.append(copy._replace(failed=True))
            raise
        self._step_copies.append(copy)

    @staticmethod
    def _device_rows(t: torch.Tensor, index: torch.Tensor | None, data: np.ndarray, n: int) -> None:
        """Gather the valid rows on the device and queue their copy into `data` (pinned), non-blocking."""
        hidden = t.shape[-1]
        src = t.detach().reshape(-1, hidden)
        rows = src if index is None else src.index_select(0, index)
        dst = torch.from_numpy(data).view(t.dtype).view(n, hidden)
        dst.copy_(rows, non_blocking=True)  # the model's stream: ordered after the layer, no record_stream needed

    def flush_device(self, block: bool) -> None:
        """Send, in order, the device copies that have landed (all of them when `block`; else at a step's end)."""
        self.flush(hold=not block)
        if self._step_copies:  # one event marks every copy of the step
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._cuda_device))
            self._device.append((event, self._step_copies))
            self._step_copies = []
        pending = self._device
        while pending and (block or pending[0][0].query()):  # type: ignore[attr-defined]
            event, copies = pending.popleft()
            event.synchronize()  # type: ignore[attr-defined]
            for c in copies:
                if c.failed:
                    if c.off is not None:
                        self.ring.release(c.off)
                    continue
                self._send_staged(c.key, c.step, c.phase, c.dtype, c.hidden, c.tokens, c.off, c.data)

    @property
    def queued(self) -> int:
        return (sum(len(c) for _, c in self._device) + len(self._step_copies) + len(self._held) + self._bundler.queued
                + self.pub.held)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=5)
