"""A bounded staging ring: hooks copy rows in, the publisher frees them in order.

    ring = StagingRing(64 << 20)
    off = ring.alloc(nbytes, block=True)    # None when full and block=False
    np.copyto(ring.bytes_at(off, nbytes).reshape(n, -1), rows)
    ...
    ring.release_oldest()                   # publisher, once ZeroMQ is done with it

One preallocated byte buffer used as a FIFO: allocations are contiguous, frees happen
in allocation order (the publisher sends in order), so memory never fragments and
the whole bus stays within `capacity` bytes. On a CUDA model the buffer is pinned so
device-to-host copies run asynchronously on a side stream.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import torch

ALIGN = 64


class StagingRing:
    def __init__(self, capacity: int, *, pinned: bool = False) -> None:
        if capacity < ALIGN:
            raise ValueError(f"capacity_bytes must be at least {ALIGN}, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pinned)
        self.array = self.buffer.numpy()
        self._live: deque[tuple[int, int]] = deque()
        self._head = 0
        self._cond = threading.Condition()
        self.stall_seconds = 0.0
        self._closed = False

    def _try_alloc(self, size: int) -> int | None:
        cap = self.capacity
        if not self._live:
            self._head = 0
            off = 0 if size <= cap else None
        else:
            tail = self._live[0][0]
            wrapped = self._live[-1][0] < tail
            if wrapped:  # free space is [head, tail)
                off = self._head if tail - self._head >= size else None
            elif cap - self._head >= size:  # free space is [head, cap) and [0, tail)
                off = self._head
            else:
                off = 0 if tail >= size else None
        if off is not None:
            self._head = off + size
            self._live.append((off, size))
        return off

    def alloc(self, nbytes: int, *, block: bool) -> int | None:
        """Offset of a fresh region of `nbytes`; waits for space when `block`."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._cond:
            off = self._try_alloc(size)
            if off is not None or not block or size > self.capacity:
                return off
            t0 = time.perf_counter()
            while off is None and not self._closed:
                self._cond.wait(0.1)
                off = self._try_alloc(size)
            self.stall_seconds += time.perf_counter() - t0
            return off

    def wait_empty(self) -> float:
        """Block until nothing is staged; returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            while self._live and not self._closed:
                self._cond.wait(0.1)
        waited = time.perf_counter() - t0
        self.stall_seconds += waited
        return waited

    def release_oldest(self) -> None:
        with self._cond:
            self._live.popleft()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def bytes_at(self, off: int, nbytes: int) -> np.ndarray:
        return self.array[off : off + nbytes]
