"""Reading recordings back: tables, filtered batch streams, torch tensors.

    table = exporters.read_recording("rec/", sites="layers.*.resid_post", phase="decode")
    for batch in exporters.iter_recording("rec/", layers=[3, 4]):   # bounded memory
        ...
    acts = exporters.activations("rec/", site="layers.3.resid_post")
    acts.tensor            # [N, hidden] torch tensor in the captured dtype (bf16 restored)
    acts.seq_id, acts.position, acts.token_id, acts.step

Filters are pushed down: files whose manifest entry cannot match are not opened;
Parquet files are scanned with a pyarrow.dataset filter (row-group statistics);
Arrow streams are filtered batch by batch on the dictionary codes before the
activation column is touched. In-progress streams (a live or killed recorder) are
read up to their last complete batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch

import probe

from ._schema import FILE_RE, PARTIAL_RE, activation_dtype, read_manifest


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
    """(complete files, in-progress streams) of a recording directory, in recording order."""
    p = Path(path)
    if p.is_file():
        return ([p], []) if not p.name.endswith(".inprogress") else ([], [p])
    if not p.is_dir():
        raise FileNotFoundError(f"no recording at {p}")

    def index(f: Path) -> int:
        m = FILE_RE.match(f.name) or PARTIAL_RE.match(f.name)
        return int(m["index"]) if m else 0

    done = sorted((f for f in p.iterdir() if FILE_RE.match(f.name)), key=index)
    partial = sorted((f for f in p.iterdir() if PARTIAL_RE.match(f.name)), key=index)
    return done, partial


def stream_batches(path: Path, *, strict: bool) -> Iterator[pa.RecordBatch]:
    """Batches of an Arrow IPC stream; with strict=False stop quietly at a truncated tail."""
    src = pa.memory_map(str(path))  # not closed here: yielded batches point into the map
    try:
        reader = pa.ipc.open_stream(src)
    except (pa.ArrowInvalid, OSError):
        if strict:
            raise
        return
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except (pa.ArrowInvalid, OSError):
            if strict:
                raise
            return  # the writer was killed (or is still writing) mid-batch
        yield batch


def _entries(path: Path) -> dict[str, dict]:
    man = read_manifest(path) if path.is_dir() else None
    out: dict[str, dict] = {}
    for e in (man or {}).get("files", []):
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
    schema = first.schema

    def gen() -> Iterator[pa.RecordBatch]:
        yield first
        for b in it:
            yield _conform(b, schema)

    return pa.RecordBatchReader.from_batches(schema, gen())


def _conform(b: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    if b.schema.equals(schema, check_metadata=False):
        return b
    if b.schema.field("activation").type != schema.field("activation").type:
        raise ValueError(f"recording mixes activation types {schema.field('activation').type} and "
                         f"{b.schema.field('activation').type}; select sites of one shape (sites=...)")
    return pa.RecordBatch.from_arrays(b.columns, schema=schema)


def read_recording(path: str | Path, *, sites: Any = None, layers: Any = None, phase: Any = None, runs: Any = None,
                   columns: list[str] | None = None, include_partial: bool = True) -> pa.Table:
    """Matching rows as one pyarrow Table (activations keep their recorded dtype; bf16 as raw uint16).

    A recording that mixes activation widths (e.g. residuals and logits) is returned
    with `activation` as a variable-size list; filter by site to keep it fixed-size.
    """
    batches = list(iter_recording(path, sites=sites, layers=layers, phase=phase, runs=runs, columns=columns,
                                  include_partial=include_partial))
    if not batches:
        schema = _any_schema(Path(path))
        if columns and schema is not None:
            schema = pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
        return schema.empty_table() if schema is not None else pa.table({})
    types = {b.schema.field("activation").type for b in batches if "activation" in b.schema.names}
    if len(types) > 1:
        batches = _widen(batches)
    schema = batches[0].schema
    return pa.Table.from_batches([_conform(b, schema) for b in batches], schema=schema)


def _widen(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    values = {b.schema.field("activation").type.value_type for b in batches}
    if len(values) > 1:
        raise ValueError(f"recording mixes activation dtypes {sorted(map(str, values))}; select sites of one dtype")
    out = []
    for b in batches:
        i = b.schema.get_field_index("activation")
        f = b.schema.field(i)
        col = b.column(i).cast(pa.list_(f.type.value_field))
        md = {k: v for k, v in (f.metadata or {}).items() if k != b"probebus.hidden"}
        out.append(b.set_column(i, pa.field("activation", col.type, f.nullable, metadata=md), col))
    return out


def _any_schema(p: Path) -> pa.Schema | None:
    done, partial = recording_files(p)
    for f in done + partial:
        if f.suffix == ".parquet":
            return ds.dataset(str(f), format="parquet").schema
        try:
            return pa.ipc.open_stream(pa.memory_map(str(f))).schema
        except (pa.ArrowInvalid, OSError):
            continue
    return None


def open_dataset(path: str | Path) -> ds.Dataset:
    """A pyarrow.dataset over a Parquet recording's complete files (lazy; filters push down)."""
    done, _ = recording_files(path)
    files = [str(f) for f in done if f.suffix == ".parquet"]
    if not files:
        raise ValueError(f"{path} has no complete Parquet files; Arrow IPC streams cannot back a Dataset "
                         "(use iter_recording / recording_reader, or record with format='parquet')")
    return ds.dataset(files, format="parquet")


@dataclass
class Activations:
    """One site's rows as torch tensors: `tensor[i]` belongs to (run[i], seq_id[i], position[i])."""

    tensor: torch.Tensor  # [N, hidden], captured dtype
    site: list[str]
    layer: torch.Tensor
    run: list[str]
    phase: list[str]
    step: torch.Tensor
    seq_id: torch.Tensor
    position: torch.Tensor
    token_id: torch.Tensor

    def __len__(self) -> int:
        return self.tensor.shape[0]


def activations(source: str | Path | pa.Table | pa.RecordBatch, site: str | None = None,
                **filters: Any) -> Activations:
    """Rows of one site (or any single-site selection) as a [N, hidden] tensor plus identity columns."""
    if isinstance(source, (str, Path)):
        table = read_recording(source, sites=site, **filters)
    else:
        table = pa.Table.from_batches([source]) if isinstance(source, pa.RecordBatch) else source
        if site is not None or filters:
            flt = _Filter.make(site, filters.get("layers"), filters.get("phase"), filters.get("runs"))
            table = pa.Table.from_batches(list(_filtered(iter(table.to_batches()), flt, None)), schema=table.schema)
    names = pc.unique(table.column("site").cast(pa.string())).to_pylist() if table.num_rows else []
    if len(names) > 1:
        raise ValueError(f"rows of {len(names)} sites selected ({', '.join(names[:6])}...); pass site=")
    field = table.schema.field("activation")
    if not pa.types.is_fixed_size_list(field.type):
        raise ValueError("activation column is not fixed-size here; select one site")
    dtype = activation_dtype(field)
    hidden = field.type.list_size
    flat = table.column("activation").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    arr = np.array(flat, copy=True).reshape(-1, hidden)  # owned and writable: torch tensors may be mutated
    tensor = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 \
        else torch.from_numpy(arr)

    def ints(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(table.column(name).to_numpy(), copy=True))

    def strs(name: str) -> list[str]:
        return table.column(name).cast(pa.string()).to_pylist()

    return Activations(tensor, strs("site"), ints("layer"), strs("run"), strs("phase"), ints("step"),
                       ints("seq_id"), ints("position"), ints("token_id"))


def recording_info(path: str | Path) -> dict[str, Any]:
    """The manifest plus what the files say: was the stop clean, what can be salvaged, what was lost."""
    p = Path(path)
    man = read_manifest(p) or {}
    done, partial = recording_files(p)
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
    }
