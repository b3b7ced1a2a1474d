"""The on-disk layout of a recording: Arrow schema, dtypes, file names, manifest.

    schema = recording_schema(torch.bfloat16, 768, file_metadata(model))
    schema.field("activation").type            # fixed_size_list<uint16>[768]
    schema.field("activation").metadata        # {b"probebus.dtype": b"bfloat16", ...}
    storage_dtype(schema.field("activation"))  # torch.bfloat16: what the reader restores

Long format, one row per (token, site):

    run, step, phase, seq_id, position, token_id, site, layer, activation

`run`, `phase` and `site` are dictionary-encoded strings; `activation` is a
fixed-size list of the captured dtype. Arrow has no bfloat16, so bf16 rows hold the
raw 16 bits as uint16 and the field metadata says `probebus.dtype = bfloat16`.

A recording directory holds `{dtype}x{hidden}-{index:05d}.arrow|.parquet` (complete,
renamed into place atomically), `*.arrow.inprogress` (the Arrow IPC stream being
written; readable up to its last flushed batch) and `manifest.json`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from importlib import metadata as _md
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

import probe

FORMAT = "probebus.recording"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".inprogress"
FILE_RE = re.compile(r"^(?P<dtype>[a-z0-9]+)x(?P<hidden>\d+)-(?P<index>\d{5,})\.(?P<ext>arrow|parquet)$")
PARTIAL_RE = re.compile(r"^(?P<dtype>[a-z0-9]+)x(?P<hidden>\d+)-(?P<index>\d{5,})\.arrow\.inprogress$")

# torch dtype -> (Arrow value type, numpy storage dtype). bf16 travels as its raw bits.
_STORAGE: dict[torch.dtype, tuple[pa.DataType, np.dtype]] = {
    torch.float32: (pa.float32(), np.dtype(np.float32)),
    torch.float16: (pa.float16(), np.dtype(np.float16)),
    torch.bfloat16: (pa.uint16(), np.dtype(np.uint16)),
    torch.float64: (pa.float64(), np.dtype(np.float64)),
    torch.int64: (pa.int64(), np.dtype(np.int64)),
    torch.int32: (pa.int32(), np.dtype(np.int32)),
    torch.uint8: (pa.uint8(), np.dtype(np.uint8)),
}

IDENTITY = ("run", "step", "phase", "seq_id", "position", "token_id", "site", "layer")
DICT_COLUMNS = ("run", "phase", "site")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_BY_NAME = {dtype_name(d): d for d in _STORAGE}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown activation dtype {name!r}; known: {sorted(_BY_NAME)}") from None


def numpy_storage(dtype: torch.dtype) -> np.dtype:
    """numpy dtype whose bytes equal the tensor's (uint16 for bfloat16)."""
    if dtype not in _STORAGE:
        raise TypeError(f"cannot record activations of dtype {dtype}; supported: {sorted(_BY_NAME)}")
    return _STORAGE[dtype][1]


def group_name(dtype: torch.dtype, hidden: int) -> str:
    """Files are grouped by activation shape: one fixed-size column type per file."""
    return f"{dtype_name(dtype)}x{hidden}"


def file_name(dtype: torch.dtype, hidden: int, index: int, ext: str) -> str:
    return f"{group_name(dtype, hidden)}-{index:05d}.{ext}"


def package_version() -> str:
    try:
        return _md.version("probebus")
    except _md.PackageNotFoundError:
        return probe.__version__


def model_metadata(model: Any) -> dict[str, str]:
    """{"model": name, "config_hash": sha256 prefix} for an nn.Module, a name, or None.

    The hash covers the config minus fields that change without changing the model
    (transformers version, local path), so two loads of one checkpoint agree.
    """
    if model is None:
        return {"model": "", "config_hash": ""}
    if isinstance(model, str):
        return {"model": model, "config_hash": ""}
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {"model": type(model).__name__, "config_hash": ""}
    name = getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or type(model).__name__
    try:
        d = cfg.to_dict()
    except Exception:  # a non-transformers config: hash what we can see
        d = dict(vars(cfg))
    for k in ("transformers_version", "_name_or_path", "name_or_path", "_commit_hash"):
        d.pop(k, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return {"model": str(name), "config_hash": hashlib.sha256(blob).hexdigest()[:16]}


def file_metadata(model: Any = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    meta = {
        "probebus.format": FORMAT,
        "probebus.format_version": str(FORMAT_VERSION),
        "probebus.version": package_version(),
        "probebus.wire_version": str(probe.VERSION),
    }
    m = model_metadata(model)
    meta["probebus.model"] = m["model"]
    meta["probebus.config_hash"] = m["config_hash"]
    for k, v in (extra or {}).items():
        meta[k if k.startswith("probebus.") else f"probebus.{k}"] = str(v)
    return meta


def recording_schema(dtype: torch.dtype, hidden: int, meta: dict[str, str]) -> pa.Schema:
    value_type = _STORAGE[dtype][0] if dtype in _STORAGE else None
    if value_type is None:
        numpy_storage(dtype)  # raises the clear error
    dstr = pa.dictionary(pa.int32(), pa.string())
    act_meta = {"probebus.dtype": dtype_name(dtype), "probebus.hidden": str(hidden)}
    if dtype == torch.bfloat16:
        act_meta["probebus.storage"] = "raw bfloat16 bits in uint16 (torch: .view(torch.bfloat16))"
    return pa.schema(
        [
            pa.field("run", dstr, nullable=False),
            pa.field("step", pa.int64(), nullable=False),
            pa.field("phase", dstr, nullable=False),
            pa.field("seq_id", pa.int64(), nullable=False),
            pa.field("position", pa.int64(), nullable=False),
            pa.field("token_id", pa.int64(), nullable=False),
            pa.field("site", dstr, nullable=False),
            pa.field("layer", pa.int32(), nullable=False),
            pa.field("activation", pa.list_(pa.field("element", value_type, nullable=False), hidden), nullable=False,
                     metadata=act_meta),
        ],
        metadata=meta,
    )


def activation_dtype(field: pa.Field) -> torch.dtype:
    """The captured torch dtype of an `activation` field (bfloat16 restored from metadata)."""
    md = field.metadata or {}
    name = md.get(b"probebus.dtype")
    if name is not None:
        return torch_dtype(name.decode())
    value = field.type.value_type
    for d, (t, _) in _STORAGE.items():
        if t == value and d != torch.bfloat16:
            return d
    raise ValueError(f"activation column of type {field.type} is not a probebus activation")


MANIFEST_SLACK = 16 << 10  # manifests are padded with spaces to a multiple of this (JSON ignores them)


def write_json_atomic(path: Path, obj: dict) -> None:
    """Readers see the old or the new manifest, never half of one -- unless the disk is full.

    The file is padded to a multiple of MANIFEST_SLACK bytes, so that when the disk is
    full (no room for a new file) the final manifest can still be written over the
    blocks the last one already holds. That fallback is not atomic, but it is what
    leaves a `failed` manifest instead of a stale `recording` one.
    """
    data = (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()
    padded = data + b" " * (-len(data) % MANIFEST_SLACK)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(padded)
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        tmp.unlink(missing_ok=True)
        _overwrite_in_place(path, data, obj, exc)


def _overwrite_in_place(path: Path, data: bytes, obj: dict, exc: OSError) -> None:
    try:
        room = path.stat().st_size
    except OSError:
        raise exc from None
    if len(data) > room:  # keep what fits: state, error and counts come first in a short form
        short = {k: obj[k] for k in ("format", "format_version", "state", "error", "counts", "lost") if k in obj}
        short["truncated_manifest"] = "the disk was full: file lists left out"
        data = (json.dumps(short) + "\n").encode()
        if len(data) > room:
            raise exc from None
    with open(path, "r+b") as f:  # overwrite allocated blocks: needs no free space
        f.write(data + b" " * (room - len(data)))


def read_manifest(directory: Path) -> dict | None:
    p = Path(directory) / MANIFEST
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p} is not a valid probebus manifest: {exc}") from None
