"""Sessions still open when the interpreter exits are closed then, so nothing they hold is lost.

    close_at_exit(session)        # ProbeSession / VllmProbe: its close(timeout=...) runs at exit unless called before
    closed(session)               # from its close(): nothing left to do at exit, and it may be collected

A session holds a decode step's captures for its linger (`_linger.py`) and sends the end
of stream only at `close()`. A process that attaches, generates and ends (the script's
end, `sys.exit`, an uncaught exception) without closing would otherwise lose every held
step and leave its subscribers without an end of stream (docs/design.md, "Costs behind the
code", Exit). `os._exit` and signals that kill the process skip this, as they skip every exit hook.
The registry holds each open session strongly: a session made inside a function that returned
without closing it still has its taps on the model (which keep its publisher alive), so it
must still be there to close at exit.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

# Imported first so that its exit hook is registered first and therefore runs last (atexit runs hooks in
# reverse): the sessions closed here then linger for their end-of-stream acknowledgements there.
from . import _publisher  # noqa: F401

EXIT_TIMEOUT_S = 10.0  # the most the sessions closed at exit wait, all together, for their end-of-stream acks

_OPEN: set[object] = set()
_LOCK = threading.Lock()


def close_at_exit(owner: object) -> None:
    """Close `owner` (anything with `close(timeout=...)`) at interpreter exit if it is still open then."""
    with _LOCK:
        _OPEN.add(owner)


def closed(owner: object) -> None:
    """`owner` was closed: forget it."""
    with _LOCK:
        _OPEN.discard(owner)


@atexit.register
def _close_open() -> None:
    with _LOCK:
        owners = list(_OPEN)
    deadline = time.monotonic() + EXIT_TIMEOUT_S  # shared: a process with many open sessions still exits soon
    for owner in owners:
        try:
            owner.close(timeout=max(0.5, deadline - time.monotonic()))  # idempotent: a closed one returns at once
        except Exception as exc:  # one session's failure must not strand the others' captures
            print(f"probebus: could not close {owner!r} at exit: {exc!r}", file=sys.stderr)
