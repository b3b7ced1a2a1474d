"""A recording in memory, shaped the way TransformerLens users read activations.

    rec = exporters.read_recording("rec/")            # Recording: short repr, HTML in notebooks
    rec.sequences()                                   # [(run, seq_id), ...]
    rec.request(0)["request_id"]                      # a vLLM session's request id for seq_id 0
    cache = rec.cache(0)                              # one sequence: {site: [pos, d_model]}
    cache["layers.3.resid_post"].shape                # torch.Size([37, 192]), captured dtype
    cache.tokens, cache.prompt                        # token strings by position, the prompt's text
    batch = rec.cache(rec.batches()[0])               # one prompt batch: {site: [batch, pos, d_model]}
    batch.mask                                        # [batch, pos] bool: False where a row is padding
    rec.table                                         # the pyarrow Table (also rec.num_rows, rec.column(...))
    acts = exporters.activations(rec, site="final_norm")   # [N, hidden] plus identity columns

Positions are each sequence's own token indices (prompt then generated tokens), as
TransformerLens' `pos`. A position captured twice (a speculative `verify` step that ran
it again) keeps the newest capture. Sequences shorter than the longest are padded at
the end with zeros and `mask` False.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ._reader import _Filter, _filtered, read_table
from ._schema import activation_dtype, activation_values, dtype_name
from ._text import read_prompts, read_requests

_SUB = {"resid_pre": 0, "attn_out": 1, "resid_mid": 2, "mlp_out": 3, "resid_post": 4}


def site_order(site: str) -> tuple[int, int, int, str]:
    """Model order: embed, then each layer's sites in forward order, then final_norm and logits."""
    parts = site.split(".")
    if parts[0] == "layers" and len(parts) == 3 and parts[1].lstrip("-").isdigit():
        return (1, int(parts[1]), _SUB.get(parts[2], 9), site)
    return ({"embed": 0, "final_norm": 2, "logits": 3}.get(site, 4), 0, 0, site)


def _strings(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(col.cast(pa.string()).to_pylist(), dtype=object)


def _to_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 (or wider) values from the file -> the captured dtype (16-bit floats narrow back exactly)."""
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.to(dtype) if t.dtype != dtype else t


def _rows(col: pa.ChunkedArray | pa.Array, n: int) -> np.ndarray:
    """A list column of equal-length rows as a [n, width] numpy array."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(n, -1) if n else flat.reshape(0, 0)


class ActivationCache(dict):
    """{site: tensor} for one sequence ([pos, d]) or several ([batch, pos, d]), plus identity.

    `seq_ids`, `run`, `mask` ([pos] or [batch, pos]), `tokens` (strings by position;
    a list per sequence for a batch), `token_ids`, `prompt` / `prompts`.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], *, run: str, seq_ids: list[int], mask: torch.Tensor,
                 token_ids: torch.Tensor, tokens: list, prompts: list[str | None], single: bool) -> None:
        super().__init__(tensors)
        self.run, self.seq_ids, self.mask, self.token_ids = run, seq_ids, mask, token_ids
        self.tokens, self.prompts, self.single = tokens, prompts, single

    @property
    def prompt(self) -> str | None:
        return self.prompts[0] if self.prompts else None

    def stack(self, sites: Iterable[str] | None = None) -> torch.Tensor:
        """Sites of one width stacked on a new first axis: [sites, (batch,) pos, d]."""
        return torch.stack([self[s] for s in (sites or list(self))])

    def __repr__(self) -> str:
        shapes = {tuple(t.shape) for t in self.values()}
        shape = next(iter(shapes)) if len(shapes) == 1 else "mixed"
        dtypes = {dtype_name(t.dtype) for t in self.values()}
        who = f"seq {self.seq_ids[0]}" if self.single else f"seqs {self.seq_ids}"
        return (f"ActivationCache({who}, run {self.run!r}, {_n(len(self), 'site')}, shape {shape}, "
                f"{'/'.join(sorted(dtypes))})")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(s)}</td><td>{list(t.shape)}</td><td>{dtype_name(t.dtype)}</td>"
                       f"<td>{t.float().norm(dim=-1).mean():.4g}</td></tr>" for s, t in self.items())
        return (f"<b>{html.escape(repr(self))}</b><table><tr><th>site</th><th>shape</th><th>dtype</th>"
                f"<th>mean ‖a‖</th></tr>{rows}</table>")


def _n(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


class Recording:
    """A recording's rows (a pyarrow Table, `.table`) with TransformerLens-shaped access.

    Table methods and attributes pass through (`num_rows`, `column`, `schema`,
    `to_pydict`, `filter`, ...), and the Arrow C stream interface makes it usable
    directly by polars (`pl.from_arrow(rec.table)`) and DuckDB (`duckdb.sql("FROM rec")`).
    """

    def __init__(self, table: pa.Table, path: str | Path | None = None,
                 prompts: dict[tuple[str, int], str] | None = None) -> None:
        self.table = table
        self.path = None if path is None else Path(path)
        self._prompts = prompts if prompts is not None else (read_prompts(self.path) if self.path else {})
        self._requests: dict[tuple[str, int], dict] | None = None  # read on first use

    # --- a Table, mostly ------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name == "table":  # not yet set (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.table, name)

    def __getitem__(self, key: Any) -> Any:
        return self.table[key]

    def __len__(self) -> int:
        return self.table.num_rows

    def __arrow_c_stream__(self, requested_schema: object = None) -> object:
        return self.table.__arrow_c_stream__(requested_schema)

    # --- identity -------------------------------------------------------------------------------
    @property
    def sites(self) -> list[str]:
        """Recorded sites, in model order."""
        if not self.table.num_rows:
            return []
        return sorted(pc.unique(self.table.column("site").cast(pa.string())).to_pylist(), key=site_order)

    def sequences(self) -> list[tuple[str, int]]:
        """(run, seq_id) of every recorded sequence, in order."""
        if not self.table.num_rows:
            return []
        pairs = pa.table({"run": self.table.column("run").cast(pa.string()), "seq": self.table.column("seq_id")})
        uniq = pairs.group_by(["run", "seq"]).aggregate([]).sort_by([("run", "ascending"), ("seq", "ascending")])
        return list(zip(uniq.column("run").to_pylist(), uniq.column("seq").to_pylist(), strict=True))

    def batches(self, run: str | None = None) -> list[list[int]]:
        """seq_ids grouped by the prefill forward that started them: the prompt batches, in order."""
        run = self._run(run)
        t = self.table.filter(pc.and_(pc.equal(self.table.column("run").cast(pa.string()), run),
                                      pc.equal(self.table.column("phase").cast(pa.string()), "prefill")))
        if not t.num_rows:
            return [[s] for r, s in self.sequences() if r == run]
        g = pa.table({"step": t.column("step"), "seq": t.column("seq_id")}).group_by("seq").aggregate(
            [("step", "min")]).sort_by([("step_min", "ascending"), ("seq", "ascending")])
        out: dict[int, list[int]] = {}
        for step, seq in zip(g.column("step_min").to_pylist(), g.column("seq").to_pylist(), strict=True):
            out.setdefault(step, []).append(seq)
        return list(out.values())

    def request(self, seq_id: int, run: str | None = None) -> dict | None:
        """A vLLM session's request for this sequence: {"seq_id", "request_id" (vLLM's), "first_position"} (from
        _requests.jsonl, which the recorder writes as requests start); None for other sessions."""
        if self._requests is None:
            self._requests = read_requests(self.path) if self.path else {}
        return self._requests.get((self._run(run), int(seq_id)))

    def prompt(self, seq_id: int, run: str | None = None) -> str | None:
        """The prompt text of a sequence, when the recorder was given it (_prompts.jsonl)."""
        return self._prompts.get((self._run(run), int(seq_id)))

    def _run(self, run: str | None) -> str:
        if run is not None:
            return run
        runs = pc.unique(self.table.column("run").cast(pa.string())).to_pylist() if self.table.num_rows else [""]
        if len(runs) > 1:
            raise ValueError(f"this recording holds {len(runs)} runs ({', '.join(runs[:4])}); pass run=")
        return runs[0]

    # --- the TransformerLens view ----------------------------------------------------------------
    def cache(self, seq_ids: int | Iterable[int], *, run: str | None = None, sites: Any = None) -> ActivationCache:
        """{site: [pos, d]} for one seq_id, or {site: [batch, pos, d]} for a list (e.g. `batches()[0]`)."""
        single = isinstance(seq_ids, (int, np.integer))
        ids = [int(seq_ids)] if single else [int(s) for s in seq_ids]  # type: ignore[union-attr]
        if not ids:
            raise ValueError("cache() needs at least one seq_id")
        run = self._run(run)
        t = self.table
        keep = pc.and_(pc.equal(t.column("run").cast(pa.string()), run), pc.is_in(t.column("seq_id"), pa.array(ids)))
        t = t.filter(keep)
        if sites is not None:
            t = pa.Table.from_batches(list(_filtered(iter(t.to_batches()), _Filter.make(sites, None, None, None),
                                                     None)), schema=t.schema)
        if not t.num_rows:
            known = [s for r, s in self.sequences() if r == run]
            raise KeyError(f"no rows for seq_id {ids if not single else ids[0]} in run {run!r} "
                           f"(recorded seq_ids: {known[:10]}{'...' if len(known) > 10 else ''})")
        t = t.sort_by([("step", "ascending")])  # later captures of a position overwrite earlier ones below
        row_of = {s: i for i, s in enumerate(ids)}
        seq = np.array([row_of[s] for s in t.column("seq_id").to_pylist()], dtype=np.int64)
        pos = np.array(t.column("position").to_numpy(), dtype=np.int64)  # a writable copy for torch indexing
        length = int(pos.max()) + 1
        site_names = _strings(t.column("site"))
        field = t.schema.field("activation")
        mask = torch.zeros(len(ids), length, dtype=torch.bool)
        mask[torch.from_numpy(seq), torch.from_numpy(pos)] = True
        token_ids = torch.zeros(len(ids), length, dtype=torch.int64)
        token_ids[torch.from_numpy(seq), torch.from_numpy(pos)] = torch.from_numpy(
            np.array(t.column("token_id").to_numpy()))
        words = [[""] * length for _ in ids]
        for s, p, w, i in zip(seq.tolist(), pos.tolist(), t.column("token").to_pylist(),
                              t.column("token_id").to_pylist(), strict=True):
            words[s][p] = w if w is not None else str(i)
        tensors = {}
        for name in sorted(set(site_names.tolist()), key=site_order):
            rows = np.flatnonzero(site_names == name)
            sub = t.take(pa.array(rows))
            dtype = activation_dtype(sub.schema.field("activation")) if field.metadata and \
                field.metadata.get(b"probebus.dtype") != b"mixed" else torch.float32
            vals = torch.from_numpy(np.array(activation_values(field, _rows(sub.column("activation"), len(rows)))))
            out = torch.zeros(len(ids), length, vals.shape[1], dtype=vals.dtype)
            out[torch.from_numpy(seq[rows]), torch.from_numpy(pos[rows])] = vals
            out = out.to(dtype)
            tensors[name] = out[0] if single else out
        prompts = [self._prompts.get((run, s)) for s in ids]
        return ActivationCache(tensors, run=run, seq_ids=ids, mask=mask[0] if single else mask,
                               token_ids=token_ids[0] if single else token_ids,
                               tokens=words[0] if single else words, prompts=prompts, single=single)

    # --- display --------------------------------------------------------------------------------
    def _summary(self) -> tuple[int, int, str]:
        t = self.table
        if not t.num_rows or "activation" not in t.schema.names:
            return 0, 0, "-"
        f = t.schema.field("activation")
        dt = (f.metadata or {}).get(b"probebus.dtype", b"?").decode()
        return len(self.sites), len(self.sequences()), dt

    def __repr__(self) -> str:
        n_sites, n_seqs, dt = self._summary()
        where = f"{str(self.path)!r}, " if self.path else ""
        # the hint reaches libraries that want a pyarrow.Table and print what they got instead, e.g.
        # datasets.Dataset(recording): "Expected a pyarrow.Table ..., but got Recording(...)"
        return (f"Recording({where}{_n(self.table.num_rows, 'row')}, {_n(n_sites, 'site')}, "
                f"{_n(n_seqs, 'sequence')}, {dt}; pass recording.table where a pyarrow.Table is expected)")

    def _repr_html_(self) -> str:
        t = self.table
        head = f"<b>{html.escape(repr(self))}</b>"
        if not t.num_rows:
            return head
        names = _strings(t.column("site"))
        lengths = pc.list_value_length(t.column("activation")).to_numpy(zero_copy_only=False)
        rows = []
        for s in self.sites:
            m = names == s
            rows.append(f"<tr><td>{html.escape(s)}</td><td>{int(m.sum()):,}</td><td>{int(lengths[m][0])}</td></tr>")
        cols = ", ".join(t.schema.names)
        return (f"{head}<br>columns: {html.escape(cols)}<table><tr><th>site</th><th>rows</th><th>width</th></tr>"
                f"{''.join(rows[:40])}</table>{'...' if len(rows) > 40 else ''}")


def read_recording(path: str | Path, *, sites: Any = None, layers: Any = None, phase: Any = None, runs: Any = None,
                   columns: list[str] | None = None, include_partial: bool = True) -> Recording:
    """Matching rows as a Recording (a pyarrow Table plus `.cache(seq_id)`); filters are pushed down.

    Activations are float32 on disk for 16-bit captures; `cache()` and `activations()`
    give them back in the captured dtype.
    """
    table = read_table(path, sites=sites, layers=layers, phase=phase, runs=runs, columns=columns,
                       include_partial=include_partial)
    p = Path(path)
    return Recording(table, p, read_prompts(p if p.is_dir() else p.parent))


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

    def __repr__(self) -> str:
        sites = sorted(set(self.site))
        return (f"Activations({len(self)} rows, site {sites[0] if len(sites) == 1 else sites}, "
                f"tensor {list(self.tensor.shape)} {dtype_name(self.tensor.dtype)})")


def activations(source: str | Path | Recording | pa.Table | pa.RecordBatch, site: str | None = None,
                **filters: Any) -> Activations:
    """Rows of one site (or any single-site selection) as a [N, hidden] tensor plus identity columns."""
    if isinstance(source, (str, Path)):
        table = read_table(source, sites=site, **filters)
    else:
        table = source.table if isinstance(source, Recording) else source
        table = pa.Table.from_batches([table]) if isinstance(table, pa.RecordBatch) else table
        if site is not None or filters:
            flt = _Filter.make(site, filters.get("layers"), filters.get("phase"), filters.get("runs"))
            table = pa.Table.from_batches(list(_filtered(iter(table.to_batches()), flt, None)), schema=table.schema)
    names = pc.unique(table.column("site").cast(pa.string())).to_pylist() if table.num_rows else []
    if len(names) > 1:
        raise ValueError(f"rows of {len(names)} sites selected ({', '.join(names[:6])}...); pass site=")
    field = table.schema.field("activation")
    if table.num_rows:
        lengths = pc.list_value_length(table.column("activation"))
        mm = pc.min_max(lengths)
        if mm["min"].as_py() != mm["max"].as_py():
            raise ValueError("activation rows of different widths selected; select one site")
    dtype = activation_dtype(field)
    vals = activation_values(field, _rows(table.column("activation"), table.num_rows))
    tensor = _to_torch(vals.copy(), dtype)  # owned and writable: torch tensors may be mutated

    def ints(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(table.column(name).to_numpy(), copy=True))

    def strs(name: str) -> list[str]:
        return table.column(name).cast(pa.string()).to_pylist()

    return Activations(tensor, strs("site"), ints("layer"), strs("run"), strs("phase"), ints("step"),
                       ints("seq_id"), ints("position"), ints("token_id"))
