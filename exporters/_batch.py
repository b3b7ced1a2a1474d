"""Accumulating captures into Arrow record batches: one copy out of the ZeroMQ frame.

    pool = SlabPool(max_pending_bytes=256 << 20)
    batcher = Batcher(pool, flush_bytes=8 << 20, flush_seconds=0.25, emit=queue.put)
    batcher.add(capture, run_code, phase_code, site_code, now)   # receiver thread
    ...
    batches = BatchBuilder().build(slab, slab.describe(), schema, dicts)   # writer thread
    pool.release(slab)                                            # once written

A `Slab` is a preallocated set of column buffers for one activation shape; the
receiver copies each capture's rows straight into it and hands full (or old) slabs
to the writer, which wraps them as Arrow arrays without copying. Slabs are recycled
so steady-state recording does no allocation and takes no page faults.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from probe import Capture

from ._schema import numpy_storage, stored_values

Key = tuple[torch.dtype, int]  # (captured dtype, hidden): one file group
ID_BYTES = 24  # seq_id, position, token_id (int64 each) per row


def slab_row_bytes(dtype: torch.dtype, hidden: int) -> int:
    """Memory one row of a slab holds: the activation plus its three ids."""
    return hidden * dtype.itemsize + ID_BYTES


class Slab:
    """Column buffers for up to `capacity` rows of one (dtype, hidden) group.

    Per row only the activation bytes and the three token ids are copied; the
    per-capture constants (step, run, phase, site, layer) are kept once per capture
    and expanded to rows in the writer thread, so the receiver does two memcpys
    and one list append per capture.
    """

    def __init__(self, dtype: torch.dtype, hidden: int, capacity: int, pooled: bool = True) -> None:
        self.dtype, self.hidden, self.capacity, self.pooled = dtype, hidden, capacity, pooled
        self.values = np.empty((capacity, hidden), numpy_storage(dtype))
        self._bytes = memoryview(self.values).cast("B")
        self.row_bytes = hidden * dtype.itemsize
        self.ids = np.empty((3, capacity), np.int64)  # seq_id, position, token_id
        self.meta: list[tuple[int, int, int, int, int, int]] = []  # (step, run, phase, site, layer, n) per capture
        self.dicts: tuple[tuple[str, ...], ...] = ()  # dictionary snapshot the codes refer to (set when emitted)
        self.rows = 0
        self.first_t = 0.0

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.ids.nbytes

    @property
    def room(self) -> int:
        return self.capacity - self.rows

    @property
    def captures(self) -> int:
        return len(self.meta)

    def reset(self) -> None:
        self.rows = 0
        self.meta = []

    def append(self, cap: Capture, run: int, phase: int, site: int, now: float) -> None:
        n = cap.n_tokens
        r = self.rows
        rb = self.row_bytes
        self._bytes[r * rb : (r + n) * rb] = cap.payload  # the one copy out of the ZeroMQ frame
        self.ids[:, r : r + n] = cap.token_array
        self.meta.append((cap.step, run, phase, site, cap.layer, n))
        if r == 0:
            self.first_t = now
        self.rows = r + n

    def describe(self) -> SlabInfo:
        """Per-capture constants as arrays plus what the manifest needs (writer thread)."""
        m = np.array(self.meta, dtype=np.int64).reshape(-1, 6)
        return SlabInfo(m, len(self.meta), self.rows, set(m[:, 1].tolist()), set(m[:, 2].tolist()),
                        set(m[:, 3].tolist()), set(m[:, 4].tolist()), int(m[:, 0].min()), int(m[:, 0].max()),
                        (int(m[-1, 1]), int(m[-1, 0])), tuple(int(x) for x in m[:, 1:4].max(axis=0)))


@dataclass
class SlabInfo:
    meta: np.ndarray  # int64 [captures, 6]: step, run, phase, site, layer, n
    captures: int
    rows: int
    runs: set[int]
    phases: set[int]
    sites: set[int]
    layers: set[int]
    step_lo: int
    step_hi: int
    last: tuple[int, int]  # (run code, step) of the newest capture
    max_codes: tuple[int, ...]  # highest run, phase, site code used: the dictionaries must be longer

    def column(self, j: int, dtype: type) -> np.ndarray:
        return np.repeat(self.meta[:, j].astype(dtype), self.meta[:, 5])


class SlabPool:
    """Recycled slabs with a bound on the bytes held by the receiver and the writer queue.

    When the writer falls behind and the bound is reached, `acquire` waits: the
    receiver stops reading the socket and back-pressure reaches the publisher (which
    blocks under `complete` and drops under `best_effort`), never unbounded memory.
    The bound holds except for one slab bigger than the bound itself, which is let
    through alone once everything else was written (a 69 MB logits capture, say).
    """

    def __init__(self, max_pending_bytes: int) -> None:
        self.max_pending = max_pending_bytes
        self.outstanding = 0
        self._free: dict[tuple[Key, int], list[Slab]] = {}
        self._free_bytes = 0  # recycled slabs count too: outstanding + free stays within the bound
        self._cond = threading.Condition()
        self._aborted = False

    def acquire(self, key: Key, capacity: int, pooled: bool,
                make_room: Callable[[], None] | None = None) -> Slab | None:
        """A reset slab of `capacity` rows, or None if the pool was aborted while waiting.

        Before waiting, `make_room()` is called once: the caller hands its own open slabs
        to the writer, so that everything the wait depends on is in the writer's hands
        (a receiver waiting for memory it holds itself would wait forever).
        """
        dtype, hidden = key
        nbytes = capacity * slab_row_bytes(dtype, hidden)
        with self._cond:
            must_wait = self.outstanding and self.outstanding + nbytes > self.max_pending
        if must_wait and make_room is not None:
            make_room()  # outside the lock: emitting an empty slab releases it here
        with self._cond:
            # One slab is always allowed, or a single oversized capture could never pass.
            while self.outstanding and self.outstanding + nbytes > self.max_pending and not self._aborted:
                self._cond.wait(0.1)
            if self._aborted:
                return None
            self.outstanding += nbytes
            free = self._free.get((key, capacity)) if pooled else None
            slab = free.pop() if free else None
            if slab is not None:
                self._free_bytes -= nbytes
            elif self._free_bytes and self.outstanding + self._free_bytes > self.max_pending:
                self._free.clear()  # a new shape needs the room: let the recycled slabs go
                self._free_bytes = 0
        if slab is None:
            slab = Slab(key[0], key[1], capacity, pooled=pooled)
        slab.reset()
        return slab

    def release(self, slab: Slab) -> None:
        with self._cond:
            nbytes = slab.capacity * slab_row_bytes(slab.dtype, slab.hidden)
            self.outstanding -= nbytes
            if slab.pooled and self.outstanding + self._free_bytes + nbytes <= self.max_pending:
                self._free.setdefault(((slab.dtype, slab.hidden), slab.capacity), []).append(slab)
                self._free_bytes += nbytes
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class Batcher:
    """Receiver-side accumulation: one open slab per activation shape, flushed by size or age."""

    def __init__(self, pool: SlabPool, *, flush_bytes: int, flush_seconds: float,
                 emit: Callable[[Slab], None]) -> None:
        self.pool = pool
        self.flush_bytes = flush_bytes
        self.flush_seconds = flush_seconds
        self.emit = emit
        self.open: dict[Key, Slab] = {}
        self.due = float("inf")  # monotonic time when the oldest open slab must be flushed

    def add(self, cap: Capture, run: int, phase: int, site: int, now: float) -> bool:
        """Copy one capture in; False if the pool was aborted (the capture is not kept)."""
        key = (cap.dtype, cap.hidden)
        n = cap.n_tokens
        slab = self.open.get(key)
        if slab is not None and slab.room < n:
            self._emit(key)
            slab = None
        if slab is None:
            rows = max(1, self.flush_bytes // slab_row_bytes(*key))
            # A capture bigger than a whole slab (a long prefill, logits) gets a one-off slab.
            slab = self.pool.acquire(key, max(rows, n), pooled=n <= rows, make_room=self.flush_all)
            if slab is None:
                return False
            self.open[key] = slab
            self.due = min(self.due, now + self.flush_seconds)
        slab.append(cap, run, phase, site, now)
        if slab.room == 0:
            self._emit(key)
        return True

    def next_due(self, now: float) -> float | None:
        """Seconds until the oldest open slab must be flushed (None when nothing is open)."""
        return None if not self.open else max(0.0, self.due - now)

    def flush_due(self, now: float) -> None:
        if now < self.due:  # the common case, checked per capture: one comparison
            return
        for key in [k for k, s in self.open.items() if now - s.first_t >= self.flush_seconds]:
            self._emit(key)

    def flush_all(self) -> None:
        for key in list(self.open):
            self._emit(key)

    def _emit(self, key: Key) -> None:
        slab = self.open.pop(key)
        self.due = min((s.first_t for s in self.open.values()), default=float("inf")) + self.flush_seconds
        if slab.rows:
            self.emit(slab)
        else:
            self.pool.release(slab)


class Dictionaries:
    """Append-only string -> code maps for the dictionary-encoded columns.

    Codes never change, and each file keeps the dictionaries it started with (the IPC
    file format allows neither replacement nor, for polars, deltas), so the recorder
    seeds them with every value it can know up front -- all phases, the session's
    sites and run -- and a file is only rotated early when a string appears that its
    dictionaries lack (a site added mid-run, a new run on the endpoint).
    """

    def __init__(self, runs: tuple[str, ...] = (), phases: tuple[str, ...] = (), sites: tuple[str, ...] = ()) -> None:
        self.codes: dict[str, dict[str, int]] = {"run": {}, "phase": {}, "site": {}}
        self.values: dict[str, tuple[str, ...]] = {"run": (), "phase": (), "site": ()}
        self._cache: dict[tuple[str, str, str], tuple[int, int, int]] = {}
        for column, values in (("run", runs), ("phase", phases), ("site", sites)):
            for v in values:
                self.code(column, v)

    def code(self, column: str, value: str) -> int:
        m = self.codes[column]
        c = m.get(value)
        if c is None:
            c = m[value] = len(m)
            self.values[column] = self.values[column] + (value,)  # new tuple: snapshots stay valid
        return c

    def codes3(self, run: str, phase: str, site: str) -> tuple[int, int, int]:
        """Codes of one capture's strings; one dict lookup in the steady state."""
        key = (run, phase, site)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = (self.code("run", run), self.code("phase", phase), self.code("site", site))
        return got

    def snapshot(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        v = self.values
        return v["run"], v["phase"], v["site"]


def covers(dicts: tuple[tuple[str, ...], ...], info: SlabInfo) -> bool:
    """True if a file's dictionaries hold every code this slab uses."""
    return all(code < len(d) for code, d in zip(info.max_codes, dicts, strict=True))


MAX_LIST_VALUES = (1 << 31) - 1  # a list array's int32 offsets: split batches beyond this


class BatchBuilder:
    """Writer-side: wraps a filled slab as record batches under a file's schema and dictionaries.

    `token_text(ids) -> pa.Array` (optional) turns token ids into their strings.
    """

    def __init__(self, token_text: Callable[[np.ndarray], pa.Array] | None = None) -> None:
        self._dict_cache: dict[tuple[str, ...], pa.Array] = {}
        self._offsets: dict[int, np.ndarray] = {}
        self.token_text = token_text

    def _dict(self, values: tuple[str, ...]) -> pa.Array:
        arr = self._dict_cache.get(values)
        if arr is None:
            arr = self._dict_cache[values] = pa.array(values, pa.string())
        return arr

    def _list_offsets(self, n: int, hidden: int) -> pa.Array:
        cached = self._offsets.get(hidden)
        if cached is None or len(cached) < n + 1:
            cached = self._offsets[hidden] = np.arange(0, (max(n, 1024) + 1) * hidden, hidden, dtype=np.int32)
        return pa.array(cached[: n + 1])

    def build(self, slab: Slab, info: SlabInfo, schema: pa.Schema,
              dicts: tuple[tuple[str, ...], ...]) -> list[pa.RecordBatch]:
        n, hidden = slab.rows, slab.hidden
        values = stored_values(slab.values[:n].reshape(-1), slab.dtype)
        runs, phases, sites = (pa.DictionaryArray.from_arrays(pa.array(info.column(j, np.int32)), self._dict(d))
                               for j, d in zip((1, 2, 3), dicts, strict=True))
        ids = [pa.array(slab.ids[i, :n]) for i in range(3)]
        tokens = self.token_text(slab.ids[2, :n]) if self.token_text is not None else pa.nulls(n, pa.string())
        step, layer = pa.array(info.column(0, np.int64)), pa.array(info.column(4, np.int32))
        out = []
        per = max(1, MAX_LIST_VALUES // hidden)
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            act = pa.ListArray.from_arrays(self._list_offsets(hi - lo, hidden),
                                           pa.array(values[lo * hidden: hi * hidden]))
            cols = [runs, step, phases, ids[0], ids[1], ids[2], tokens, sites, layer]
            cols = [c if (lo, hi) == (0, n) else c.slice(lo, hi - lo) for c in cols]
            out.append(pa.RecordBatch.from_arrays([*cols, act], schema=schema))
        return out
