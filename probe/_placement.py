"""Which cores the bus's background threads may use (ZeroMQ's I/O thread, the control thread).

    parent_cpus()                 # the cores of our parent process (a vLLM engine), or None
    usable_cpus({1})              # the requested cores this process may run on, or None (with a warning)
"""

from __future__ import annotations

import os
import warnings


def parent_cpus() -> set[int] | None:
    """The cores our parent process may use (a vLLM worker's engine, a launcher), or None if unknown."""
    try:
        return os.sched_getaffinity(os.getppid())
    except OSError:
        return None


def usable_cpus(cpus: set[int] | None) -> set[int] | None:
    """The cores of `cpus` this process's threads may run on (ours, or our parent's), or None.

    libzmq aborts the whole process when its I/O thread's affinity names no usable core
    (`pthread_setaffinity_np` fails and it asserts), so a bad `io_cpus` is dropped here, with a warning."""
    if not cpus:
        return None
    usable = os.sched_getaffinity(0) | (parent_cpus() or set())
    if not set(cpus) & usable:
        warnings.warn(f"probebus: io_cpus {sorted(cpus)} are not cores this process may use ({sorted(usable)}); "
                      "the bus's threads stay on the process's own cores", stacklevel=3)
    return (set(cpus) & usable) or None
