"""A bounded staging ring for payloads that ZeroMQ sends zero-copy.

    ring = StagingRing(64 << 20)
    off = ring.alloc(nbytes)                 # None when full
    np.copyto(ring.bytes_at(off, nbytes), rows)
    ring.release(off, held)                  # a weakref that dies when ZeroMQ is done (None: free at once)
    ring.reclaim()                           # frees, in order, every slot ZeroMQ is done with

One preallocated byte buffer used as a FIFO: allocations are contiguous and are freed
in allocation order, so memory never fragments and staged payloads stay within
`capacity` bytes. The ring wraps back to its start early, once the live slots sit past
`SOFT_END` and the front has room: a subscriber that keeps up then reuses the same few
megabytes, warm in the cache, instead of touching all of `capacity` (a copy into
never-touched pages costs several times one into reused ones: docs/design.md, "Costs behind the code"). Only the
model's thread allocates and reclaims (no lock, no other thread). On a CUDA model the
buffer is pinned so device-to-host copies run asynchronously (the host does not wait).

The buffer's first `PREFAULT` bytes are made resident when the ring is built (at
attach), not on the first copies into them: a copy into never-touched pages costs the
kernel a page fault per 4 KiB, and a session's first prefill would pay it on the model's
thread (docs/design.md, "Costs behind the code", Memory).
"""

from __future__ import annotations

import mmap
from collections import deque

import numpy as np
import torch

ALIGN = 64
PREFAULT = 64 << 20  # made resident at build time (the rest of a larger ring faults in when first used)
SOFT_END = 8 << 20  # the ring wraps early past this many bytes (or 4 captures' worth, if more)
_STAGED = object()  # a slot whose capture has not been handed to ZeroMQ yet


class StagingRing:
    def __init__(self, capacity: int, *, pinned: bool = False) -> None:
        if capacity < ALIGN:
            raise ValueError(f"capacity_bytes must be at least {ALIGN}, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        if pinned:  # pinned pages are resident from the start
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
            self.array = self.buffer.numpy()
        else:
            self.array = _resident(self.capacity, PREFAULT)
            self.buffer = torch.from_numpy(self.array)
        self._live: deque[tuple[int, int]] = deque()  # (offset, size) in allocation order
        self._holds: dict[int, object] = {}  # offset -> _STAGED (not sent yet), a weakref, or None
        self._head = 0

    @property
    def used(self) -> int:
        return sum(size for _, size in self._live)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh region of `nbytes`, or None when it does not fit now."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        off = self._try_alloc(size)
        if off is None and self._live:
            self.reclaim()
            off = self._try_alloc(size)
        return off

    def _try_alloc(self, size: int) -> int | None:
        cap = self.capacity
        if not self._live:
            self._head = 0
            off = 0 if size <= cap else None
        else:
            tail = self._live[0][0]
            if self._live[-1][0] < tail:  # wrapped: free space is [head, tail)
                off = self._head if tail - self._head >= size else None
            elif tail >= size and self._head + size > max(SOFT_END, 4 * size):  # wrap early: stay warm
                off = 0
            elif cap - self._head >= size:  # free space is [head, cap) and [0, tail)
                off = self._head
            else:
                off = 0 if tail >= size else None
        if off is not None:
            self._head = off + size
            self._live.append((off, size))
            self._holds[off] = _STAGED
        return off

    def release(self, off: int, held: object = None) -> None:
        """The slot at `off` may be reused once the weakref `held` is dead (at once when None)."""
        self._holds[off] = held

    def reclaim(self) -> int:
        """Free every leading slot whose send has completed; returns how many are still held."""
        holds, live = self._holds, self._live
        while live:
            h = holds[live[0][0]]
            if h is _STAGED or (h is not None and h() is not None):  # type: ignore[operator]
                break
            del holds[live.popleft()[0]]
        return len(live)

    def bytes_at(self, off: int, nbytes: int) -> np.ndarray:
        return self.array[off : off + nbytes]


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name


def _resident(nbytes: int, prefault: int) -> np.ndarray:
    """`nbytes` of private anonymous memory whose first `prefault` bytes are already mapped."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not a POSIX mmap: let the first copies fault the pages in
        return np.empty(nbytes, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive
    head = min(nbytes, prefault)
    try:
        region.madvise(_MADV_POPULATE_WRITE, 0, head)  # one call: the kernel maps and zeroes the pages
    except (OSError, ValueError):  # an older kernel: touch one byte per page instead
        array[:head:mmap.PAGESIZE] = 0
    return array
