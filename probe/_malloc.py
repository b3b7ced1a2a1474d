"""Keep a receiving process's freed frames mapped, so the next large frame costs no page faults.

    from probe._malloc import keep_freed_frames
    keep_freed_frames()        # once per process; Subscriber(tune_malloc=True) does it for you

ZeroMQ's I/O thread mallocs every received message of its size. glibc gives a large one
fresh pages (mmap, or a heap grown after the last free trimmed it), and the first write to
each page faults. With 3 MiB captures that was most of a Subscriber's CPU per message;
with glibc told to keep up to 64 MiB of freed memory per arena and to serve allocations
under 32 MiB from the heap, next to no faults (docs/design.md, "Costs behind the code",
Memory). (The dynamic thresholds glibc starts with did not settle here: the Subscriber's
small allocations between the large ones kept the heap's top trimmed.)

The cost is memory: a process may keep up to 64 MiB of freed heap per malloc arena
instead of returning it at once. The settings are process-wide, so they are applied
only on glibc, only where the user has set none of glibc's own MALLOC_*_ variables,
and never when PROBEBUS_TUNE_MALLOC=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 64 << 20  # freed memory a heap keeps before returning its top to the kernel
MMAP_THRESHOLD = 32 << 20  # allocations below this come from the heap (glibc's largest allowed value)
_USER_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_state: bool | None = None  # None: not tried yet in this process


def keep_freed_frames() -> bool:
    """Set glibc's trim and mmap thresholds once per process; True if this process runs with them.

    False where it does not apply: not glibc, the user's own MALLOC_*_ settings, PROBEBUS_TUNE_MALLOC=0,
    or a mallopt that refused the values."""
    global _state
    if _state is None:
        _state = _apply()
    return _state


def _apply() -> bool:
    if os.environ.get("PROBEBUS_TUNE_MALLOC", "1") == "0" or any(v in os.environ for v in _USER_VARS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl and others have no such symbol)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: setting either turns off glibc's dynamic adjustment of both.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
