"""Per-site statistics of a recording, computed in one streaming pass.

    s = summarize_recording("rec/")
    s["state"], s["rows"], s["bytes"]
    for site in s["sites"]:
        site["site"], site["layer"], site["rows"], site["sequences"], site["tokens"],
        site["bytes"], site["dtype"], site["norm_mean"], site["norm_max"]

`tokens` counts distinct (run, seq_id, position); it is below `rows` only when a
position was captured twice (e.g. a speculative `verify` step re-running it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ._reader import iter_recording, recording_info
from ._schema import activation_dtype, activation_values, dtype_name
from ._text import read_requests


class _Site:
    def __init__(self, site: str, layer: int, dtype: str, hidden: int) -> None:
        self.site, self.layer, self.dtype, self.hidden = site, layer, dtype, hidden
        self.rows = self.bytes = 0
        self.norm_sum = 0.0
        self.norm_max = 0.0
        self.keys: list[np.ndarray] = []  # (run, seq_id, position) packed, for distinct counts

    def result(self) -> dict[str, Any]:
        keys = np.unique(np.concatenate(self.keys)) if self.keys else np.empty(0, np.int64)
        seqs = np.unique(keys >> 24) if len(keys) else keys
        return {"site": self.site, "layer": self.layer, "dtype": self.dtype, "hidden": self.hidden,
                "rows": self.rows, "sequences": int(len(seqs)), "tokens": int(len(keys)), "bytes": self.bytes,
                "norm_mean": self.norm_sum / self.rows if self.rows else 0.0, "norm_max": self.norm_max}


def summarize_recording(path: str | Path) -> dict[str, Any]:
    info = recording_info(path)
    sites: dict[str, _Site] = {}
    runs: dict[str, int] = {}
    for batch in iter_recording(path):
        field = batch.schema.field("activation")
        dtype = activation_dtype(field)
        flat = activation_values(field, batch.column("activation").flatten().to_numpy(zero_copy_only=False))
        hidden = len(flat) // max(1, batch.num_rows)  # one file, one width
        vals = flat.reshape(-1, hidden)
        norms = np.linalg.norm(vals.astype(np.float32, copy=False), axis=1)
        site_col, run_col = batch.column("site"), batch.column("run")
        site_codes = site_col.indices.to_numpy()
        run_map = np.array([runs.setdefault(r, len(runs)) for r in run_col.dictionary.to_pylist()] or [0], np.int64)
        run_ids = run_map[run_col.indices.to_numpy()]
        # Packed key: run (16 bits) | seq_id (24 bits) | position (24 bits); fine for inspection-size counts.
        keys = (run_ids << 48) | ((batch.column("seq_id").to_numpy() & 0xFFFFFF) << 24) | \
            (batch.column("position").to_numpy() & 0xFFFFFF)
        layers = batch.column("layer").to_numpy()
        names = site_col.dictionary.to_pylist()
        row_bytes = hidden * dtype.itemsize
        for code in np.unique(site_codes):
            m = site_codes == code
            name = names[code]
            s = sites.get(name)
            if s is None:
                s = sites[name] = _Site(name, int(layers[m][0]), dtype_name(dtype), hidden)
            n = int(m.sum())
            s.rows += n
            s.bytes += n * row_bytes
            s.norm_sum += float(norms[m].sum(dtype=np.float64))
            s.norm_max = max(s.norm_max, float(norms[m].max()))
            s.keys.append(keys[m])
    out = dict(info)
    per_site = sorted((s.result() for s in sites.values()), key=lambda r: (r["layer"] < 0, r["layer"], r["site"]))
    out["sites"] = per_site
    out["rows"] = sum(r["rows"] for r in per_site)
    out["bytes"] = sum(r["bytes"] for r in per_site)
    out["requests"] = len(read_requests(Path(path)))  # a vLLM session's seq_id -> request map (_requests.jsonl)
    return out
