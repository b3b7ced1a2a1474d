"""Reading recordings back: tables, filtered batch streams, torch tensors.

    rec = exporters.read_recording("rec/", sites="layers.*.resid_post", phase="decode")
    rec.cache(0)["layers.3.resid_post"]          # [pos, d_model] of sequence 0 (see Recording)
    for batch in exporters.iter_recording("rec/", layers=[3, 4]):   # bounded memory
        ...
    acts = exporters.activations("rec/", site="layers.3.resid_post")
    acts.tensor            # [N, hidden] torch tensor in the captured dtype (bf16 restored)

Filters are pushed down: files whose manifest entry cannot match are not opened;
Parquet files are scanned with a pyarrow.dataset filter (row-group statistics);
Arrow files are filtered batch by batch on the dictionary codes before the
activation column is touched. In-progress files (a live or killed recorder) are
read up to their last complete batch. Recordings of format 1 (IPC streams,
fixed-size lists, bf16 as uint16 bits) still read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

import probe

from ._safe import check_schema, member
from ._schema import FILE_RE, IPC_FILE_MAGIC, PARTIAL_RE, PARTIAL_SUFFIX, read_manifest


@dataclass(frozen=True)
class _Filter:
    sites: probe.SiteMatcher | None
    layers: frozenset[int] | None
    phases: frozenset[str] | None
    runs: frozenset[str] | None

    @classmethod
    def make(cls, sites: Any, layers: Any, phase: Any, runs: Any) -> _Filter:
        def strs(v: Any) -> frozenset[str] | None:
            return None if v is None else frozenset([v] if isinstance(v, str) else v)

        lay = None if layers is None else frozenset([layers] if isinstance(layers, int) else (int(x) for x in layers))
        phases = strs(phase)
        if phases is not None and not phases <= set(probe.PHASES):
            raise ValueError(f"phase must be among {probe.PHASES}, got {sorted(phases)}")
        return cls(None if sites is None else probe.SiteMatcher(sites), lay, phases, strs(runs))

    def file_may_match(self, entry: dict | None) -> bool:
        """Manifest-level pruning: skip a file that holds none of the requested rows."""
        if entry is None:
            return True
        if self.sites is not None and not any(self.sites.matches(s) for s in entry.get("sites", [])):
            return False
        if self.layers is not None and not self.layers & set(entry.get("layers", [])):
            return False
        if self.phases is not None and not self.phases & set(entry.get("phases", [])):
            return False
        return self.runs is None or bool(self.runs & set(entry.get("runs", [])))

    def mask(self, batch: pa.RecordBatch) -> pa.Array | None:
        """Boolean mask of matching rows, or None when every row matches."""
        masks = []
        for name, keep in (("site", self.sites), ("phase", self.phases), ("run", self.runs)):
            if keep is None:
                continue
            col = batch.column(name)
            values = col.dictionary.to_pylist()
            ok = self.sites.matches if name == "site" else keep.__contains__  # type: ignore[union-attr]
            codes = pa.array([i for i, v in enumerate(values) if ok(v)], col.indices.type)
            masks.append(pc.is_in(col.indices, value_set=codes))
        if self.layers is not None:
            masks.append(pc.is_in(batch.column("layer"), value_set=pa.array(sorted(self.layers), pa.int32())))
        if not masks:
            return None
        m = masks[0]
        for other in masks[1:]:
            m = pc.and_(m, other)
        return m

    def expression(self, site_names: Iterable[str]) -> ds.Expression | None:
        exprs = []
        if self.sites is not None:
            exprs.append(ds.field("site").isin([s for s in site_names if self.sites.matches(s)]))
        if self.phases is not None:
            exprs.append(ds.field("phase").isin(sorted(self.phases)))
        if self.runs is not None:
            exprs.append(ds.field("run").isin(sorted(self.runs)))
        if self.layers is not None:
            exprs.append(ds.field("layer").isin(sorted(self.layers)))
        if not exprs:
            return None
        e = exprs[0]
        for x in exprs[1:]:
            e = e & x
        return e


def recording_files(path: str | Path) -> tuple[list[Path], list[Path]]:
    """(complete files, in-progress files) of a recording directory, in recording order.

    A path to one data file is a recording of that file alone. Raises FileNotFoundError
    (with what to do) for a missing path or a directory that holds no recording.
    """
    p = Path(path)
    if p.is_file():
        if p.name.endswith(PARTIAL_SUFFIX):
            return [], [p]
        if p.suffix in (".arrow", ".parquet", ".feather", ".ipc"):
            return [p], []
        raise FileNotFoundError(f"{p} is a file but not a recording's data file (.arrow or .parquet); pass the "
                                "recording's directory")
    if not p.is_dir():
        raise FileNotFoundError(f"no recording at {p}: no such file or directory")

    def index(f: Path) -> int:
        m = FILE_RE.match(f.name) or PARTIAL_RE.match(f.name)
        return int(m["index"]) if m else 0

    names = list(p.iterdir())
    done = sorted((member(p, f) for f in names if FILE_RE.match(f.name)), key=index)
    partial = sorted((member(p, f) for f in names if PARTIAL_RE.match(f.name)), key=index)
    if not done and not partial and read_manifest(p) is None:
        raise FileNotFoundError(f"{p} holds no probebus recording (no _manifest.json, no .arrow/.parquet files); "
                                "record one with `probebus record --out DIR`")
    return done, partial


def stream_batches(path: Path, *, strict: bool) -> Iterator[pa.RecordBatch]:
    """Batches of one data file: a complete IPC file, an IPC file still being written (or cut by a
    crash: everything after its magic is a stream), or a format-1 IPC stream. With strict=False a
    truncated tail ends the iteration quietly."""
    src = pa.memory_map(str(path))  # not closed here: yielded batches point into the map
    try:
        is_file = src.read(len(IPC_FILE_MAGIC)) == IPC_FILE_MAGIC
        if is_file and not path.name.endswith(PARTIAL_SUFFIX):
            reader = pa.ipc.open_file(src)
            check_schema(reader.schema, path)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            return
        src.seek(len(IPC_FILE_MAGIC) if is_file else 0)
        stream = pa.ipc.open_stream(src)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        if strict:
            raise pa.ArrowInvalid(f"{path} is not a readable Arrow file ({exc}); it may be truncated or "
                                  "not a probebus recording") from None
        return
    check_schema(stream.schema, path)  # a partial file whose columns are not ours is not salvaged, it is refused
    while True:
        try:
            batch = stream.read_next_batch()
        except StopIteration:
            return
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
            if strict:
                raise
            return  # the writer was killed (or is still writing) mid-batch
        yield batch


def _entries(path: Path) -> dict[str, dict]:
    man = read_manifest(path) if path.is_dir() else None
    out: dict[str, dict] = {}
    for e in (man or {}).get("files") or []:  # their types checked by read_manifest
        out[e["name"]] = e
    return out


def iter_recording(path: str | Path, *, sites: Any = None, layers: Any = None, phase: Any = None,
                   runs: Any = None, columns: list[str] | None = None, include_partial: bool = True,
                   batch_rows: int | None = None) -> Iterator[pa.RecordBatch]:
    """Matching rows as record batches, file by file, without loading the recording."""
    flt = _Filter.make(sites, layers, phase, runs)
    p = Path(path)
    done, partial = recording_files(p)
    entries = _entries(p)
    for f in done + (partial if include_partial else []):
        if not flt.file_may_match(entries.get(f.name)):
            continue
        if f.suffix == ".parquet":
            batches = _parquet_batches(f, flt, columns, batch_rows, entries.get(f.name))
        else:
            batches = _filtered(stream_batches(f, strict=f in done), flt, columns)
        for b in batches:
            if batch_rows and b.num_rows > batch_rows:
                for off in range(0, b.num_rows, batch_rows):
                    yield b.slice(off, batch_rows)
            elif b.num_rows:
                yield b


def _filtered(batches: Iterator[pa.RecordBatch], flt: _Filter, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    for b in batches:
        m = flt.mask(b)
        if m is not None:
            if not pc.any(m).as_py():
                continue
            if not pc.all(m).as_py():
                b = b.filter(m)
        yield b.select(columns) if columns else b


def _parquet_batches(f: Path, flt: _Filter, columns: list[str] | None, batch_rows: int | None,
                     entry: dict | None) -> Iterator[pa.RecordBatch]:
    dset = ds.dataset(str(f), format="parquet")
    check_schema(dset.schema, f)
    names: list[str] = []
    if flt.sites is not None:  # the filter needs concrete names: from the manifest, else the site column alone
        names = entry["sites"] if entry else sorted({v for c in dset.to_table(columns=["site"]).column("site").chunks
                                                      for v in c.dictionary.to_pylist()})
    scanner = dset.scanner(columns=columns, filter=flt.expression(names), batch_size=batch_rows or 131_072)
    yield from scanner.to_batches()


def recording_reader(path: str | Path, **filters: Any) -> pa.RecordBatchReader:
    """A RecordBatchReader over matching rows, e.g. for DuckDB (`FROM reader`) or polars.from_arrow."""
    it = iter_recording(path, **filters)
    first = next(it, None)
    if first is None:
        raise ValueError(f"no rows in {path} match {filters or 'anything'}")
    schema = _neutral(first.schema)

    def gen() -> Iterator[pa.RecordBatch]:
        yield _conform(first, schema)
        for b in it:
            yield _conform(b, schema)

    return pa.RecordBatchReader.from_batches(schema, gen())


def _neutral(schema: pa.Schema) -> pa.Schema:
    """A schema every file of the recording fits: no per-file width in the activation's metadata."""
    if "activation" not in schema.names:
        return schema
    i = schema.get_field_index("activation")
    f = schema.field(i)
    md = {k: v for k, v in (f.metadata or {}).items() if k != b"probebus.hidden"}
    typ = pa.list_(f.type.value_type) if pa.types.is_fixed_size_list(f.type) else f.type  # format 1: fixed lists
    return schema.set(i, pa.field("activation", typ, f.nullable, metadata=md or None))


def _conform(b: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    if b.schema.equals(schema, check_metadata=True):
        return b
    cols = b.columns
    if "activation" in b.schema.names:
        i = b.schema.get_field_index("activation")
        have, want = b.schema.field(i).type, schema.field(i).type
        if have.value_type != want.value_type:
            raise ValueError(f"recording mixes activation types {want} and {have}; select sites of one dtype "
                             "(sites=...)")
        if have != want:
            cols = [*cols[:i], cols[i].cast(want), *cols[i + 1:]]
    if "token" in schema.names and "token" not in b.schema.names:  # format 1 files had no token column
        j = schema.get_field_index("token")
        cols = [*cols[:j], pa.nulls(b.num_rows, pa.string()), *cols[j:]]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def read_table(path: str | Path, *, sites: Any = None, layers: Any = None, phase: Any = None, runs: Any = None,
               columns: list[str] | None = None, include_partial: bool = True) -> pa.Table:
    """Matching rows as one pyarrow Table (activations as stored: float32 for 16-bit captures)."""
    batches = list(iter_recording(path, sites=sites, layers=layers, phase=phase, runs=runs, columns=columns,
                                  include_partial=include_partial))
    if not batches:
        schema = _any_schema(Path(path))
        if columns and schema is not None:
            schema = pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
        return _neutral(schema).empty_table() if schema is not None else pa.table({})
    schema = _neutral(batches[0].schema)
    if "activation" in schema.names:
        dtypes = {(b.schema.field("activation").metadata or {}).get(b"probebus.dtype") for b in batches}
        if len(dtypes) > 1:  # e.g. bf16 residuals and fp32 logits: both float32 on disk, the name is per file
            i = schema.get_field_index("activation")
            f = schema.field(i)
            schema = schema.set(i, f.with_metadata({**(f.metadata or {}), b"probebus.dtype": b"mixed"}))
    return pa.Table.from_batches([_conform(b, schema) for b in batches], schema=schema)


def _any_schema(p: Path) -> pa.Schema | None:
    done, partial = recording_files(p)
    for f in done + partial:
        if f.suffix == ".parquet":
            return ds.dataset(str(f), format="parquet").schema
        for b in stream_batches(f, strict=False):
            return b.schema
    return None


def open_dataset(path: str | Path) -> ds.Dataset:
    """A pyarrow.dataset over a recording's complete files (lazy; filters push down), Arrow or Parquet."""
    done, _ = recording_files(path)
    parquet = [str(f) for f in done if f.suffix == ".parquet"]
    arrow = [str(f) for f in done if f.suffix == ".arrow"]
    if not parquet and not arrow:
        raise ValueError(f"{path} has no complete files yet (a recorder is running or was killed); "
                         "iter_recording / read_recording also read the in-progress ones")
    if parquet and arrow:
        return ds.dataset([ds.dataset(parquet, format="parquet"), ds.dataset(arrow, format="ipc")])
    return ds.dataset(parquet or arrow, format="parquet" if parquet else "ipc")


def recording_info(path: str | Path) -> dict[str, Any]:
    """The manifest plus what the files say: was the stop clean, what can be salvaged, what was lost."""
    p = Path(path)
    done, partial = recording_files(p)
    man = (read_manifest(p) if p.is_dir() else None) or {}
    salvaged = {}
    for f in partial:
        salvaged[f.name] = sum(b.num_rows for b in stream_batches(f, strict=False))
    state = man.get("state", "unknown (no manifest)")
    return {
        "path": str(p), "state": state, "clean": state == "complete" and not partial,
        "model": man.get("model", ""), "config_hash": man.get("config_hash", ""),
        "probebus_version": man.get("probebus_version", ""), "file_format": man.get("file_format", ""),
        "files": [f.name for f in done], "partial_files": salvaged, "salvaged_rows": sum(salvaged.values()),
        "manifest_rows": (man.get("counts") or {}).get("rows"), "lost": man.get("lost", "unknown"),
        "last_written": man.get("last_written"), "error": man.get("error"), "counts": man.get("counts", {}),
        "interrupted_by": man.get("interrupted_by"),
    }
