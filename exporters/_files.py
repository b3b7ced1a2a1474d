"""The writer's files: Arrow IPC files written in place, renamed or converted when complete.

    files = FileSet(Path("rec"), "parquet", rotate_bytes=256 << 20, meta=file_metadata(model))
    files.write(slab, info, builder)  # appends to the slab's group (a new file if its dictionaries lack a value)
    files.rotate_if_full(key)         # renames/converts it once it reached rotate_bytes
    files.finish_all()                # every group complete: renamed (arrow) or converted (parquet)
    files.entries()                   # what the manifest lists
    existing_recording(Path("rec"))   # the files of a recording already there (the recorder refuses to mix)

Data always goes first into `_{group}-{index}.arrow.inprogress`, an Arrow IPC *file*
written through an unbuffered OS file. An IPC file is an 8-byte magic, then exactly
an IPC stream, then a footer: once `write_batch` returns the batch is in the kernel,
so after a SIGKILL everything past the magic reads as a stream up to the last whole
batch. Closing writes the footer (what DuckDB, polars, pyarrow.dataset and feather
need) and the file is renamed into place atomically; in Parquet mode it is converted
to Parquet (one row group per ~64 MiB) next to it and removed, so it doubles as
Parquet's crash journal (a Parquet file without its footer is unreadable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ._batch import BatchBuilder, Key, Slab, SlabInfo, covers
from ._schema import (
    DICT_COLUMNS,
    FILE_RE,
    IDENTITY,
    LEGACY_MANIFEST,
    MANIFEST,
    PARTIAL_PREFIX,
    PARTIAL_RE,
    PARTIAL_SUFFIX,
    PROMPTS,
    REQUESTS,
    dtype_name,
    file_name,
    recording_schema,
)

_IPC_OPTIONS = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=False)


def open_sink(path: str) -> pa.NativeFile:
    """Unbuffered output file: what the writer wrote has reached the kernel (tests patch this for disk-full)."""
    return pa.OSFile(path, "wb")


@dataclass
class FileEntry:
    """What the manifest says about one file."""

    name: str
    dtype: str
    hidden: int
    rows: int = 0
    captures: int = 0
    bytes: int = 0
    runs: set[int] = field(default_factory=set)
    phases: set[int] = field(default_factory=set)
    sites: set[int] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)
    step_lo: int | None = None
    step_hi: int | None = None
    last: tuple[int, int] = (-1, -1)

    def add(self, slab: SlabInfo) -> None:
        self.rows += slab.rows
        self.captures += slab.captures
        self.runs |= slab.runs
        self.phases |= slab.phases
        self.sites |= slab.sites
        self.layers |= slab.layers
        self.step_lo = slab.step_lo if self.step_lo is None else min(self.step_lo, slab.step_lo)
        self.step_hi = slab.step_hi if self.step_hi is None else max(self.step_hi, slab.step_hi)
        self.last = slab.last

    def as_json(self, dicts: tuple[tuple[str, ...], ...]) -> dict:
        runs, phases, sites = dicts
        return {
            "name": self.name, "rows": self.rows, "captures": self.captures, "bytes": self.bytes,
            "dtype": self.dtype, "hidden": self.hidden,
            "runs": sorted(runs[i] for i in self.runs), "phases": sorted(phases[i] for i in self.phases),
            "sites": sorted(sites[i] for i in self.sites), "layers": sorted(self.layers),
            "steps": [self.step_lo, self.step_hi],
        }


@dataclass
class _Open:
    entry: FileEntry
    partial: Path
    final: Path
    sink: pa.NativeFile
    writer: pa.ipc.RecordBatchFileWriter
    dicts: tuple[tuple[str, ...], ...]  # fixed for the file's life: the IPC file format allows one dictionary


class FileSet:
    def __init__(self, directory: Path, fmt: str, *, rotate_bytes: int, meta: dict[str, str],
                 row_group_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self.fmt = fmt
        self.rotate_bytes = rotate_bytes
        self.meta = meta
        self.row_group_bytes = row_group_bytes
        self.done: list[FileEntry] = []
        self.open: dict[Key, _Open] = {}
        self.stranded: list[_Open] = []  # closed streams whose rename/conversion failed: still salvageable
        self.schemas: dict[Key, pa.Schema] = {}
        self._index = 0

    def schema(self, key: Key) -> pa.Schema:
        s = self.schemas.get(key)
        if s is None:
            s = self.schemas[key] = recording_schema(key[0], key[1], self.meta)
        return s

    def write(self, slab: Slab, info: SlabInfo, builder: BatchBuilder) -> None:
        key = (slab.dtype, slab.hidden)
        o = self.open.get(key)
        if o is not None and not covers(o.dicts, info):
            self.finish(key)  # a run or site this file's dictionaries lack: start the next file
            o = None
        o = o or self._start(key, slab.dicts)
        for batch in builder.build(slab, info, self.schema(key), o.dicts):
            o.writer.write_batch(batch)
        o.entry.add(info)
        o.entry.bytes = o.sink.tell()

    def rotate_if_full(self, key: Key) -> bool:
        """Finish the group's file once it reached `rotate_bytes` (separate from write: a failed
        rename must not make an already written batch count as lost)."""
        o = self.open.get(key)
        if o is None or o.entry.bytes < self.rotate_bytes:
            return False
        self.finish(key)
        return True

    def _start(self, key: Key, dicts: tuple[tuple[str, ...], ...]) -> _Open:
        final = self.directory / file_name(key[0], key[1], self._index, self.fmt)
        partial = self.directory / (PARTIAL_PREFIX + file_name(key[0], key[1], self._index, "arrow") + PARTIAL_SUFFIX)
        self._index += 1
        sink = open_sink(str(partial))
        try:
            writer = pa.ipc.new_file(sink, self.schema(key), options=_IPC_OPTIONS)
        except BaseException:
            sink.close()
            raise
        entry = FileEntry(final.name, dtype_name(key[0]), key[1])
        o = self.open[key] = _Open(entry, partial, final, sink, writer, dicts)
        return o

    def finish(self, key: Key) -> FileEntry:
        """Close one group's stream and put the complete file in place."""
        o = self.open.pop(key)
        self.stranded.append(o)
        try:
            o.writer.close()  # the footer: now a complete IPC file
        finally:
            o.sink.close()
        if self.fmt == "parquet":
            o.entry.bytes = self._to_parquet(o.partial, o.final)
            os.unlink(o.partial)
        else:
            os.replace(o.partial, o.final)  # atomic: readers see a complete file or none
        self.stranded.remove(o)
        self.done.append(o.entry)
        return o.entry

    def finish_all(self) -> None:
        for key in list(self.open):
            self.finish(key)

    def abandon(self) -> None:
        """After a write error: close handles, keep partial streams for salvage, write nothing more."""
        for o in self.open.values():
            try:
                o.sink.close()
            except OSError:
                pass
        self.open.clear()

    def _to_parquet(self, partial: Path, final: Path) -> int:
        tmp = final.with_name(PARTIAL_PREFIX + final.name + ".tmp")
        with pa.memory_map(str(partial)) as src:
            ipc = pa.ipc.open_file(src)
            reader = (ipc.get_batch(i) for i in range(ipc.num_record_batches))
            sink = open_sink(str(tmp))
            try:
                # Activations barely compress and need no statistics; identity columns benefit from both.
                writer = pq.ParquetWriter(
                    sink, ipc.schema, compression={c: "zstd" for c in IDENTITY} | {"activation": "none"},
                    use_dictionary=[*DICT_COLUMNS, "token"], write_statistics=list(IDENTITY),
                    store_schema=True)
                group: list[pa.RecordBatch] = []
                size = 0
                for batch in reader:
                    group.append(batch)
                    size += batch.nbytes
                    if size >= self.row_group_bytes:
                        self._write_group(writer, group)
                        group, size = [], 0
                if group:
                    self._write_group(writer, group)
                writer.close()
                nbytes = sink.tell()
            except BaseException:
                sink.close()
                tmp.unlink(missing_ok=True)  # the stream stays: it is the crash journal
                raise
            finally:
                if not sink.closed:
                    sink.close()
        os.replace(tmp, final)
        return nbytes

    @staticmethod
    def _write_group(writer: pq.ParquetWriter, group: list[pa.RecordBatch]) -> None:
        table = pa.Table.from_batches(group)
        writer.write_table(table, row_group_size=max(1, table.num_rows))

    def totals(self) -> tuple[list[str], int]:
        """(complete file names, bytes on disk incl. open files); safe to call from another thread."""
        done = list(self.done)  # list() of a list/dict view is atomic under the GIL; the writer may append
        return [e.name for e in done], sum(e.bytes for e in done) + sum(o.entry.bytes for o in list(self.open.values()))

    def entries(self, dicts: tuple[tuple[str, ...], ...]) -> tuple[list[dict], list[dict]]:
        """(complete files, in-progress files) for the manifest (writer thread only: sets may grow)."""
        done = [e.as_json(dicts) for e in self.done]
        partial = []
        for o in [*self.open.values(), *self.stranded]:
            d = o.entry.as_json(dicts)
            d["name"] = o.partial.name
            d["final_name"] = o.final.name
            partial.append(d)
        return done, partial


def existing_recording(path: str | Path) -> list[Path]:
    """The files of a recording already in `path` (empty if none, or if `path` does not exist)."""
    p = Path(path)
    if not p.is_dir():
        return []
    return [f for f in p.iterdir()
            if f.name in (MANIFEST, MANIFEST + ".tmp", PROMPTS, REQUESTS, LEGACY_MANIFEST) or FILE_RE.match(f.name)
            or PARTIAL_RE.match(f.name) or f.name.endswith(".parquet.tmp")]
