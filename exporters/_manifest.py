"""What a recording says about itself: the summary `stop()` returns and `_manifest.json`, kept current.

    rec.summary                  # RecordingSummary(rows=..., files=[...], dropped=..., clean=True, ...)
    rec._save_manifest(force=False)   # the recorder's threads: at most every manifest_interval seconds
    json.load(open("rec/_manifest.json"))["lost"]   # one sentence on what the recording is missing

The manifest is rewritten atomically while the recorder runs (`state: recording`, the files
done and in progress, the counts, the last step written) and once more at the end, so a
recorder killed mid-run still leaves a folder that says what it holds and what it lost.

A mixin of `ArrowRecorder` (`_recorder.py`), which owns the counters, the files and the threads.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from ._schema import FORMAT, FORMAT_VERSION, MANIFEST, write_json_atomic


@dataclass(frozen=True)
class RecordingSummary:
    """What a recorder wrote. `dropped` = missed + unwritten: published captures this recording lacks.

    `missed` comes from the bus' per-site sequence numbers and end-of-stream counts
    (exact); `gaps` is the older estimate from steps a site skipped, kept as a cross
    check. `publisher_dropped` (best_effort, a ProbeSession only) never reached the bus.
    `malformed` counts frames that were not captures at all (not in `dropped`).
    """

    path: str
    rows: int
    bytes: int
    files: list[str]
    captures: int  # captures written
    received: int
    dropped: int
    malformed: int
    missed: int  # published captures that never arrived (sequence gaps, end-of-stream counts)
    gaps: int  # (step, site) captures detected missing, e.g. best_effort drops
    unwritten: int  # received but not written because writing failed
    publisher_dropped: int | None  # the observed session's own counter, when recording a ProbeSession
    seconds: float
    clean: bool
    truncated: bool  # stop() timed out while captures were still arriving
    error: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _lost_text(state: str, c: dict[str, Any], last: dict | None) -> str:
    """One sentence, in the manifest, on what this recording is missing."""
    after = f"after run {last['run']} step {last['step']}" if last else "at all"
    if state == "recording":
        return (f"recorder running (or killed): if this manifest is not updated again, {c['pending']} captures "
                f"received but not yet written and everything published {after} are lost; "
                "_*.inprogress files hold every batch written so far")
    parts = [f"{c[k]} {k}" for k in ("missed", "unwritten") if c[k]]
    if c.get("publisher_dropped"):
        parts.append(f"{c['publisher_dropped']} dropped by the publisher (best_effort)")
    if state == "failed":
        parts.append(f"everything published {after}")
    return "nothing" if not parts else "; ".join(parts)

class Reporting:
    """The summary and the manifest, from `ArrowRecorder`'s state (set in its __init__ and threads)."""

    def _counts(self) -> dict[str, Any]:
        sub = self._sub
        malformed = sub.stats.malformed if sub is not None else 0
        missed = getattr(sub.stats, "missed", None) if sub is not None else 0
        pub = self._session.stats.dropped if self._session is not None else None
        return {"received": self._received, "captures_written": self._written, "rows": self._rows,
                "malformed": malformed, "missed": self._gaps.total if missed is None else missed,
                "gaps": self._gaps.total, "unwritten": self._unwritten,
                "publisher_dropped": pub,
                "torn": getattr(sub.stats, "torn", 0) if sub is not None else 0,  # flagged after their send
                "pending": max(0, self._received - self._written - self._unwritten)}

    def _snapshot(self, final: bool) -> RecordingSummary:
        c = self._counts()
        names, nbytes = self._files.totals()
        end = self._t1 if final and self._t1 else time.monotonic()
        return RecordingSummary(
            path=str(self.path), rows=c["rows"], bytes=nbytes, files=[str(self.path / n) for n in names],
            captures=c["captures_written"], received=c["received"],
            dropped=c["missed"] + c["unwritten"], malformed=c["malformed"], missed=c["missed"], gaps=c["gaps"],
            unwritten=c["unwritten"], publisher_dropped=c["publisher_dropped"],
            seconds=max(0.0, end - self._t0) if self._t0 else 0.0,
            clean=final and self._error is None and not self._truncated, truncated=self._truncated,
            error=self._error)

    def _save_manifest(self, force: bool, final: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._saved_at < self.manifest_interval:
            return
        if not self._manifest_lock.acquire(timeout=2.0):  # the other writer is stuck in the file system
            return
        try:
            if self._abandoned and not final:
                return
            self._saved_at = now
            self._write_manifest()
        finally:
            self._manifest_lock.release()

    def _write_manifest(self) -> None:
        dicts = self._dicts.snapshot()
        done, partial = self._files.entries(dicts)
        c = self._counts()
        runs = dicts[0]
        last = {"run": runs[self._last[0]], "step": self._last[1]} if self._last[0] >= 0 else None
        write_json_atomic(self.path / MANIFEST, {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "probebus_version": self._meta["probebus.version"],
            "wire_version": int(self._meta["probebus.wire_version"]),
            "model": self._meta["probebus.model"], "config_hash": self._meta["probebus.config_hash"],
            "metadata": {k: v for k, v in self._meta.items() if k not in (
                "probebus.format", "probebus.format_version", "probebus.version", "probebus.wire_version",
                "probebus.model", "probebus.config_hash")},
            "file_format": self.format, "endpoint": self.endpoint,
            "sites": self.sites if self.sites is None or isinstance(self.sites, str) else list(self.sites),
            "state": self._state, "error": self._error, "interrupted": self._interrupted is not None,
            "interrupted_by": self._interrupted, "started_at": self._started_at, "updated_at": utc_now(),
            "files": done, "in_progress": partial, "counts": c, "last_written": last,
            "lost": _lost_text(self._state, c, last),
        })
