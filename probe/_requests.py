"""A subscriber's copy of a vLLM session's request map: which vLLM request each seq_id is.

    sub.info.requests[cap.seq_ids[0]]   # {"seq_id": 3, "request_id": "7", "first_position": 0,
                                        #  "cached_positions": 0, "joined": False}
    sub.take_requests()                 # entries that arrived since the last call (a recorder writes them)

The worker assigns seq_ids in the order requests start (0, 1, 2 ...). The session info
carries the whole map (its last 10,000 entries) and goes out when a subscriber joins;
each step that starts requests sends only their entries (REQUESTS_TOPIC), because
re-encoding the whole map at every such step cost a busy worker milliseconds a step
(docs/design.md, "Costs behind the code", Session info).
Consecutive seq_ids make a lost message visible: an entry past the next expected one
means one went missing (a best-effort subscriber dropped it at its high-water mark), and
the subscriber asks for the whole map again by re-announcing its presence (at most once
a second), which makes the publisher send its info to every subscriber.
"""

from __future__ import annotations

import math
import time

from ._discovery import seq_id_key

KEEP = 100_000  # entries a subscriber keeps (oldest dropped first); the worker keeps 10,000
_RESYNC_EVERY_S = 1.0


class RequestMap:
    def __init__(self) -> None:
        self.entries: dict[int, dict] = {}  # seq_id -> entry, oldest first (shared with `SessionInfo.requests`)
        self.highest = -1  # the highest seq_id known
        self.have_info = False  # a session info has set the baseline: from then on a skipped seq_id is a loss
        self._new: list[dict] = []  # entries not yet taken
        self._resync_at = 0.0

    def from_info(self, requests: dict[int, dict]) -> dict[int, dict]:
        """Merge an info's whole map into what is known; returns the merged map for the new `SessionInfo`."""
        self.have_info = True
        self._add(requests)
        return self.entries

    def from_delta(self, requests: dict) -> bool:
        """Merge a REQUESTS_TOPIC message's entries; True when one was skipped (a message was lost) and the
        whole map should be asked for again now. TypeError / ValueError, and nothing merged, on a bad entry."""
        if not isinstance(requests, dict):
            raise TypeError("the request map is not an object")
        new = {seq_id_key(k): v for k, v in requests.items()}
        if not new:
            return False
        gap = self.have_info and min(new) > self.highest + 1
        self._add(new)
        if gap and time.monotonic() - self._resync_at >= _RESYNC_EVERY_S:
            self._resync_at = time.monotonic()
            return True
        return False

    def _add(self, requests: dict[int, dict]) -> None:
        for seq_id, entry in requests.items():  # all checked before any is merged: a bad message changes nothing
            check_entry(seq_id, entry)
        entries = self.entries
        for seq_id, entry in requests.items():
            if seq_id not in entries:
                self._new.append(entry)
            entries[seq_id] = entry
            self.highest = max(self.highest, seq_id)
        while len(entries) > KEEP:
            del entries[next(iter(entries))]
        if len(self._new) > KEEP:
            del self._new[: len(self._new) - KEEP]

    def take(self) -> list[dict]:
        new, self._new = self._new, []
        return new


# the fields consumers read, typed ("joined", a bool, is a JSON scalar like any other)
_ENTRY_TYPES = {"seq_id": int, "first_position": int, "request_id": str, "cached_positions": int}


def check_entry(seq_id: int, entry: object) -> None:
    """TypeError / ValueError unless `entry` is an object of JSON scalars whose known fields have their types (a
    recorder writes entries to its _requests.jsonl as they come, and readers use them as typed)."""
    if not isinstance(entry, dict):
        raise TypeError(f"request entry {seq_id} is not an object")
    for name, value in entry.items():
        if not isinstance(name, str) or not (value is None or isinstance(value, (str, int, float))):
            raise TypeError(f"request entry {seq_id} has a field that is not a JSON scalar")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"request entry {seq_id}: {name} is not finite")
        want = _ENTRY_TYPES.get(name)
        if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
            raise TypeError(f"request entry {seq_id}: {name} is a {type(value).__name__}")
