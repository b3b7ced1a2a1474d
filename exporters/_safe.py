"""Reading a recording folder that may not be what it claims: regular files only, nothing outside it, sizes capped.

    path = member(folder, folder / "bf16x768-00000.arrow")    # RecordingError unless a regular file in the folder
    text = read_capped(folder / "_manifest.json", MANIFEST_MAX)   # never blocks on a FIFO, never reads 8 GB
    check_schema(schema, path)                                  # RecordingError unless the columns are ours

A recording may come from someone else (a shared disk, an archive). Without these checks a
FIFO named `_manifest.json` or `x-00000.arrow` hung `probebus inspect` and `read_recording`
on open, a manifest linked to /dev/zero or an 8 GB sparse file was read whole, and a data
file linked to a file outside the folder was read as part of the recording. A link that
stays inside the folder is followed (some tools deduplicate with links).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow as pa

MANIFEST_MAX = 64 << 20  # a manifest lists files: ~300 bytes each, so this is 200,000 files
SIDECAR_MAX = 1 << 30  # _prompts.jsonl / _requests.jsonl: read whole, so bounded


class RecordingError(ValueError):
    """A recording folder holds something a recording cannot (one line: what, and what to do)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return f"a {name}"
    return "not a regular file"


def member(folder: Path, path: Path) -> Path:
    """`path` if it is a regular file of `folder` (through links that stay inside it); else RecordingError.
    FileNotFoundError when it does not exist."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = Path(os.path.realpath(path))
        if not target.is_relative_to(Path(os.path.realpath(folder))):
            raise RecordingError(f"{path} is a link to {target}, outside the recording; a recording is read from "
                                 "its own folder only: copy the file in or remove the link")
        st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise RecordingError(f"{path} is {_kind(st.st_mode)}, not a regular file; a recording holds regular files "
                             "only: remove it")
    return path


def read_capped(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file of its folder of at most `limit` bytes; else RecordingError.
    Opened without blocking and checked again once open (the name may have changed since `member`)."""
    member(path.parent, path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordingError(f"{path} is {_kind(st.st_mode)}, not a regular file: remove it")
        if st.st_size > limit:
            raise RecordingError(f"{path} is {st.st_size:,} bytes, more than the {limit:,} such a file may have; "
                                 "it is not a probebus recording's (remove it)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)  # a file that grows while read still stops here
    finally:
        os.close(fd)
    if len(data) > limit:
        raise RecordingError(f"{path} grew past {limit:,} bytes while read: remove it")
    return data


_COLUMNS = ("run", "step", "phase", "seq_id", "position", "token_id", "site", "layer", "activation")


def check_schema(schema: pa.Schema, path: Path) -> None:
    """RecordingError unless `schema` has a recording's columns with their types (readers index them)."""
    missing = [c for c in _COLUMNS if c not in schema.names]
    if missing:
        raise RecordingError(f"{path} is not a probebus data file (no {', '.join(missing)} column); remove it")
    for name in ("run", "phase", "site"):
        t = schema.field(name).type
        if not pa.types.is_dictionary(t) or not pa.types.is_string(t.value_type):
            raise RecordingError(f"{path} is not a probebus data file (its {name} column is {t}); remove it")
    for name in ("step", "seq_id", "position", "token_id", "layer"):
        if not pa.types.is_integer(schema.field(name).type):
            raise RecordingError(f"{path} is not a probebus data file (its {name} column is "
                                 f"{schema.field(name).type}); remove it")
    act = schema.field("activation").type
    if not (pa.types.is_list(act) or pa.types.is_fixed_size_list(act) or pa.types.is_large_list(act)) or \
            not (pa.types.is_floating(act.value_type) or pa.types.is_integer(act.value_type)):
        raise RecordingError(f"{path} is not a probebus data file (its activation column is {act}); remove it")
