"""Finish the in-progress files of a recording whose recorder was killed, so every reader sees their rows.

    report = exporters.repair_recording("rec/")    # [{"file": "f32x64-00000.arrow", "rows": 1520, "from": ...}]
    probebus inspect rec/ --repair                  # the same from the command line, then the usual summary

A recorder writes each group into `_<name>.arrow.inprogress` (a magic, then an IPC stream)
and gives it its footer and final name at rotation or stop. Killed (SIGKILL, OOM, power),
it leaves the stream without a footer under a name that starts with "_": `read_recording`
salvages it, but DuckDB, polars and `pyarrow.dataset` skip it and saw 0 rows of a recording
that never rotated. Repair writes every whole batch of each such stream into a complete
file under the name the recorder would have given it (Parquet for a Parquet recording),
atomically, removes the stream, and moves its manifest entry to the complete files.
A stream that was written in the last `busy_s` seconds of a recording still marked as
recording may belong to a live recorder: repair refuses rather than race it.
"""

from __future__ import annotations

import os
import time
from itertools import chain
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ._reader import recording_files, stream_batches
from ._safe import RecordingError
from ._schema import MANIFEST, PARTIAL_RE, read_manifest, write_json_atomic


def repair_recording(path: str | Path, *, busy_s: float = 10.0) -> list[dict[str, Any]]:
    """Finish every in-progress file of the recording at `path`; returns what was done, one dict per file.

    RecordingError when a stream may still be written by a live recorder, or its final name is taken."""
    p = Path(path)
    if not p.is_dir():
        raise RecordingError(f"{p} is not a recording folder; --repair works on a folder")
    _, partial = recording_files(p)
    man = read_manifest(p)
    live = man is not None and man.get("state") == "recording"
    now = time.time()
    for f in partial:
        age = now - f.stat().st_mtime
        if live and age < busy_s:
            raise RecordingError(f"{f} was written {age:.1f} s ago and the manifest says recording: a recorder may "
                                 "still be running; stop it (or wait) before --repair")
    fmt = (man or {}).get("file_format") or "arrow"
    done = []
    for f in partial:
        m = PARTIAL_RE.match(f.name)
        assert m is not None  # recording_files matched it
        final = p / f"{m['dtype']}x{m['hidden']}-{m['index']}.{'parquet' if fmt == 'parquet' else 'arrow'}"
        if os.path.lexists(final):
            raise RecordingError(f"cannot finish {f.name}: {final.name} exists already; move one of them away")
        rows = _finish(f, final)
        f.unlink()
        done.append({"file": final.name if rows else None, "rows": rows, "from": f.name})
    if done and man is not None:
        _update_manifest(p, man, done)
    return done


def _finish(partial: Path, final: Path) -> int:
    """Write the whole batches of `partial` into `final` (a temporary name, then an atomic rename); 0 and no file
    for a stream that holds no whole batch (there is nothing to keep)."""
    batches = stream_batches(partial, strict=False)
    first = next(batches, None)
    if first is None:
        return 0
    tmp = final.with_name("_" + final.name + ".repair")
    rows = 0
    try:
        if final.suffix == ".parquet":
            with pq.ParquetWriter(str(tmp), first.schema, store_schema=True) as w:
                for b in chain([first], batches):
                    w.write_batch(b)
                    rows += b.num_rows
        else:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, first.schema) as w:
                for b in chain([first], batches):
                    w.write_batch(b)
                    rows += b.num_rows
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return rows


def _update_manifest(p: Path, man: dict, done: list[dict]) -> None:
    entries = {e.get("name"): e for e in man.get("in_progress") or []}
    files = list(man.get("files") or [])
    for d in done:
        entry = dict(entries.pop(d["from"], None) or {})
        if d["file"] is None:  # a stream with no whole batch: removed, nothing to list
            continue
        entry.pop("final_name", None)
        entry.update(name=d["file"], rows=d["rows"], bytes=(p / d["file"]).stat().st_size)
        files.append(entry)
    man.update(files=files, in_progress=list(entries.values()), state="repaired",
               lost=f"repaired after the recorder stopped uncleanly: {sum(d['rows'] for d in done):,} rows of "
                    f"{len(done)} unfinished file(s) kept; what it had not yet written is lost",
               updated_at=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()))
    write_json_atomic(p / MANIFEST, man)
