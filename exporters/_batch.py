"""Accumulating captures into Arrow record batches: one copy out of the ZeroMQ frame.

    pool = SlabPool(max_pending_bytes=256 << 20)
    batcher = Batcher(pool, flush_bytes=8 << 20, flush_seconds=0.25, emit=queue.put)
    batcher.add(capture, run_code, phase_code, site_code, now)   # receiver thread
    ...
    batch = to_record_batch(slab, schema, dictionaries)           # writer thread
    pool.release(slab)                                            # once written

A `Slab` is a preallocated set of column buffers for one activation shape; the
receiver copies each capture's rows straight into it and hands full (or old) slabs
to the writer, which wraps them as Arrow arrays without copying. Slabs are recycled
so steady-state recording does no allocation and takes no page faults.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from probe import Capture

from ._schema import numpy_storage

Key = tuple[torch.dtype, int]  # (captured dtype, hidden): one file group


@dataclass
class Slab:
    """Column buffers for up to `capacity` rows of one (dtype, hidden) group."""

    dtype: torch.dtype
    hidden: int
    capacity: int
    pooled: bool = True
    rows: int = 0
    captures: int = 0
    first_t: float = 0.0
    runs: set[int] = field(default_factory=set)
    phases: set[int] = field(default_factory=set)
    sites: set[int] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)
    step_lo: int = 0
    step_hi: int = -1
    last: tuple[int, int] = (-1, -1)  # (run code, step) of the newest capture
    dicts: tuple[tuple[str, ...], ...] = ()  # dictionary snapshot the codes refer to (set when emitted)

    def __post_init__(self) -> None:
        store = numpy_storage(self.dtype)
        self.values = np.empty((self.capacity, self.hidden), store)
        # bf16 arrives as a torch tensor we can only expose to numpy as int16: same bits.
        self._dst = self.values.view(np.int16) if self.dtype == torch.bfloat16 else self.values
        self.ints = np.empty((4, self.capacity), np.int64)  # step, seq_id, position, token_id
        self.codes = np.empty((4, self.capacity), np.int32)  # run, phase, site, layer

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.ints.nbytes + self.codes.nbytes

    @property
    def room(self) -> int:
        return self.capacity - self.rows

    def reset(self) -> None:
        self.rows = self.captures = 0
        for s in (self.runs, self.phases, self.sites, self.layers):
            s.clear()
        self.step_lo, self.step_hi, self.last = 0, -1, (-1, -1)

    def append(self, cap: Capture, run: int, phase: int, site: int, now: float) -> None:
        n = cap.tensor.shape[0]
        r = self.rows
        src = cap.tensor.view(torch.int16) if self.dtype == torch.bfloat16 else cap.tensor
        self._dst[r : r + n] = src.numpy()
        ints, codes = self.ints, self.codes
        ints[0, r : r + n] = cap.step
        ids = getattr(cap, "token_array", None)  # int64 [3, n] view on the frame, when the probe offers it
        if ids is not None:
            ints[1:, r : r + n] = ids
        else:
            ints[1, r : r + n] = cap.seq_ids.numpy()
            ints[2, r : r + n] = cap.positions.numpy()
            ints[3, r : r + n] = cap.token_ids.numpy()
        codes[0, r : r + n] = run
        codes[1, r : r + n] = phase
        codes[2, r : r + n] = site
        codes[3, r : r + n] = cap.layer
        if self.rows == 0:
            self.first_t = now
            self.step_lo = cap.step
        self.rows = r + n
        self.captures += 1
        self.runs.add(run)
        self.phases.add(phase)
        self.sites.add(site)
        self.layers.add(cap.layer)
        self.step_lo = min(self.step_lo, cap.step)
        self.step_hi = max(self.step_hi, cap.step)
        self.last = (run, cap.step)


class SlabPool:
    """Recycled slabs with a bound on the bytes held by the receiver and the writer queue.

    When the writer falls behind and the bound is reached, `acquire` waits: the
    receiver stops reading the socket and back-pressure reaches the publisher (which
    blocks under `complete` and drops under `best_effort`), never unbounded memory.
    """

    def __init__(self, max_pending_bytes: int) -> None:
        self.max_pending = max_pending_bytes
        self.outstanding = 0
        self._free: dict[tuple[Key, int], list[Slab]] = {}
        self._cond = threading.Condition()
        self._aborted = False

    def acquire(self, key: Key, capacity: int, pooled: bool) -> Slab | None:
        """A reset slab of `capacity` rows, or None if the pool was aborted while waiting."""
        dtype, hidden = key
        nbytes = capacity * (hidden * dtype.itemsize + 48)
        with self._cond:
            # One slab is always allowed, or a single oversized capture could never pass.
            while self.outstanding and self.outstanding + nbytes > self.max_pending and not self._aborted:
                self._cond.wait(0.1)
            if self._aborted:
                return None
            self.outstanding += nbytes
            free = self._free.get((key, capacity)) if pooled else None
            slab = free.pop() if free else None
        if slab is None:
            slab = Slab(key[0], key[1], capacity, pooled=pooled)
        slab.reset()
        return slab

    def release(self, slab: Slab) -> None:
        with self._cond:
            self.outstanding -= slab.capacity * (slab.hidden * slab.dtype.itemsize + 48)
            if slab.pooled:
                self._free.setdefault(((slab.dtype, slab.hidden), slab.capacity), []).append(slab)
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

    def add(self, cap: Capture, run: int, phase: int, site: int, now: float) -> bool:
        """Copy one capture in; False if the pool was aborted (the capture is not kept)."""
        t = cap.tensor
        key = (t.dtype, t.shape[1])
        n = t.shape[0]
        slab = self.open.get(key)
        if slab is not None and slab.room < n:
            self._emit(key)
            slab = None
        if slab is None:
            rows = max(1, self.flush_bytes // (key[1] * t.dtype.itemsize))
            # A capture bigger than a whole slab (a long prefill, logits) gets a one-off slab.
            slab = self.pool.acquire(key, max(rows, n), pooled=n <= rows)
            if slab is None:
                return False
            self.open[key] = slab
        slab.append(cap, run, phase, site, now)
        if slab.room == 0:
            self._emit(key)
        return True

    def next_due(self, now: float) -> float | None:
        """Seconds until the oldest open slab must be flushed (None when nothing is open)."""
        if not self.open:
            return None
        oldest = min(s.first_t for s in self.open.values())
        return max(0.0, oldest + self.flush_seconds - now)

    def flush_due(self, now: float) -> None:
        for key in [k for k, s in self.open.items() if now - s.first_t >= self.flush_seconds]:
            self._emit(key)

    def flush_all(self) -> None:
        for key in list(self.open):
            self._emit(key)

    def _emit(self, key: Key) -> None:
        slab = self.open.pop(key)
        if slab.rows:
            self.emit(slab)
        else:
            self.pool.release(slab)


class Dictionaries:
    """Append-only string -> code maps for the dictionary-encoded columns.

    Codes never change, so every batch of a file can share one growing dictionary;
    a new string makes the IPC writer emit one replacement dictionary (deltas would
    be smaller, but polars cannot read delta dictionaries).
    """

    def __init__(self) -> None:
        self.codes: dict[str, dict[str, int]] = {"run": {}, "phase": {}, "site": {}}
        self.values: dict[str, tuple[str, ...]] = {"run": (), "phase": (), "site": ()}

    def code(self, column: str, value: str) -> int:
        m = self.codes[column]
        c = m.get(value)
        if c is None:
            c = m[value] = len(m)
            self.values[column] = self.values[column] + (value,)  # new tuple: snapshots stay valid
        return c

    def snapshot(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        v = self.values
        return v["run"], v["phase"], v["site"]


class BatchBuilder:
    """Writer-side: wraps a filled slab as a RecordBatch (no copy) under a file schema."""

    def __init__(self) -> None:
        self._dict_cache: dict[tuple[str, ...], pa.Array] = {}

    def _dict(self, values: tuple[str, ...]) -> pa.Array:
        arr = self._dict_cache.get(values)
        if arr is None:
            arr = self._dict_cache[values] = pa.array(values, pa.string())
        return arr

    def build(self, slab: Slab, schema: pa.Schema, dicts: tuple[tuple[str, ...], ...]) -> pa.RecordBatch:
        n = slab.rows
        act_type = schema.field("activation").type
        act = pa.FixedSizeListArray.from_arrays(pa.array(slab.values[:n].reshape(-1)), type=act_type)
        runs, phases, sites = (pa.DictionaryArray.from_arrays(pa.array(slab.codes[i, :n]), self._dict(d))
                               for i, d in enumerate(dicts))
        ints = [pa.array(slab.ints[i, :n]) for i in range(4)]
        layer = pa.array(slab.codes[3, :n])
        return pa.RecordBatch.from_arrays([runs, ints[0], phases, ints[1], ints[2], ints[3], sites, layer, act],
                                          schema=schema)
