"""Sessions still open when the interpreter exits are closed then, so nothing they hold is lost.

    close_at_exit(session)        # ProbeSession / VllmProbe: its close(timeout=...) runs at exit unless called before

A session holds a decode step's captures for its linger (`_linger.py`) and sends the end
of stream only at `close()`. A process that attaches, generates and ends (the script's
end, `sys.exit`, an uncaught exception) without closing would otherwise lose every held
step and leave its subscribers without an end of stream (measured: 40 of 40 lost, `missed`
0). `os._exit` and signals that kill the process skip this, as they skip every exit hook.
"""

from __future__ import annotations

import atexit
import sys
import weakref

# Imported first so that its exit hook is registered first and therefore runs last (atexit runs hooks in
# reverse): the sessions closed here then linger for their end-of-stream acknowledgements there.
from . import _publisher  # noqa: F401

EXIT_TIMEOUT_S = 10.0  # the most a closed session waits for its subscribers to acknowledge the end, at exit

_OPEN: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(owner: object) -> None:
    """Close `owner` (anything with `close(timeout=...)`) at interpreter exit if it is still open then."""
    _OPEN.add(owner)


@atexit.register
def _close_open() -> None:
    for owner in list(_OPEN):
        try:
            owner.close(timeout=EXIT_TIMEOUT_S)  # idempotent: a closed one returns at once
        except Exception as exc:  # one session's failure must not strand the others' captures
            print(f"probebus: could not close {owner!r} at exit: {exc!r}", file=sys.stderr)
