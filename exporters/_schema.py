"""The on-disk layout of a recording: Arrow schema, dtypes, file names, manifest.

    schema = recording_schema(torch.bfloat16, 768, file_metadata(model))
    schema.field("activation").type            # list<item: float>: float32 on disk
    schema.field("activation").metadata        # {b"probebus.dtype": b"bfloat16", b"probebus.hidden": b"768"}
    activation_dtype(schema.field("activation"))  # torch.bfloat16: what `activations()` restores

Long format, one row per (token, site):

    run, step, phase, seq_id, position, token_id, token, site, layer, activation

`run`, `phase` and `site` are dictionary-encoded strings (one fixed dictionary per
file); `token` is the token's text when the recorder had the tokenizer (else null).
`activation` is a variable-size list, so files of different widths (residuals and
logits) share one schema and every reader can open the whole folder at once.
16-bit captures are stored as float32 (bf16 and fp16 widen exactly; Arrow has no
bfloat16 and some readers no float16): every reader gets floats, and the field
metadata `probebus.dtype` names the captured dtype, which `activations()` restores.

A recording directory holds `{dtype}x{hidden}-{index:05d}.arrow|.parquet` (complete
Arrow IPC *files* or Parquet, renamed into place atomically), `_*.arrow.inprogress`
(the IPC file being written: its magic, then a plain IPC stream, readable up to the
last written batch after a crash), `_manifest.json` and, when the recorder was given
prompts, `_prompts.jsonl`. Names starting with "_" are skipped by folder readers
(pyarrow.dataset; globs on *.arrow never match them).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

import probe

from ._safe import MANIFEST_MAX, read_capped

FORMAT = "probebus.recording"
FORMAT_VERSION = 2  # 1: IPC streams, fixed-size lists, bf16 as raw uint16 bits (still readable)
# Everything that is not a complete data file starts with "_" (as Spark's _SUCCESS and _metadata do), so
# that folder readers -- pyarrow.dataset("rec/", format="ipc") and DuckDB/polars globs -- see data files only.
MANIFEST = "_manifest.json"
LEGACY_MANIFEST = "manifest.json"  # format 1
PROMPTS = "_prompts.jsonl"
REQUESTS = "_requests.jsonl"  # a vLLM session's seq_id -> request id, one JSON line per request
PARTIAL_PREFIX = "_"
PARTIAL_SUFFIX = ".inprogress"
FILE_RE = re.compile(r"^(?P<dtype>[a-z0-9]+)x(?P<hidden>\d+)-(?P<index>\d{5,})\.(?P<ext>arrow|parquet)$")
PARTIAL_RE = re.compile(r"^_?(?P<dtype>[a-z0-9]+)x(?P<hidden>\d+)-(?P<index>\d{5,})\.arrow\.inprogress$")
IPC_FILE_MAGIC = b"ARROW1\x00\x00"  # an IPC file is this, a stream, a footer, and the magic again

# The one dtype table is probe's wire table; from it: how the receiver holds a capture's
# bytes (numpy has no bfloat16: raw uint16 bits) and what Arrow type the files store.
_WIRE_DTYPES: dict[int, torch.dtype] = getattr(probe, "DTYPES", None) or __import__(
    "probe._wire", fromlist=["DTYPES"]).DTYPES
_WIDENED = (torch.bfloat16, torch.float16)  # stored as float32


def _numpy_of(dtype: torch.dtype) -> np.dtype:
    return np.dtype(np.uint16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


_STORAGE: dict[torch.dtype, tuple[pa.DataType, np.dtype]] = {
    d: (pa.float32() if d in _WIDENED else pa.from_numpy_dtype(_numpy_of(d)), _numpy_of(d))
    for d in _WIRE_DTYPES.values()
}

# Every row's identity columns, in file order, then `activation`: the one list of them (the schema below, and
# `_files.py`'s Parquet settings, derive from it).
_DSTR = pa.dictionary(pa.int32(), pa.string())
IDENTITY_FIELDS = (
    pa.field("run", _DSTR, nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("phase", _DSTR, nullable=False),
    pa.field("seq_id", pa.int64(), nullable=False),
    pa.field("position", pa.int64(), nullable=False),
    pa.field("token_id", pa.int64(), nullable=False),
    pa.field("token", pa.string()),
    pa.field("site", _DSTR, nullable=False),
    pa.field("layer", pa.int32(), nullable=False),
)
IDENTITY = tuple(f.name for f in IDENTITY_FIELDS)
DICT_COLUMNS = tuple(f.name for f in IDENTITY_FIELDS if pa.types.is_dictionary(f.type))  # run, phase, site


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_BY_NAME = {dtype_name(d): d for d in _STORAGE}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown activation dtype {name!r}; known: {sorted(_BY_NAME)}") from None


def numpy_storage(dtype: torch.dtype) -> np.dtype:
    """numpy dtype whose bytes equal the tensor's (uint16 for bfloat16): how the receiver holds rows."""
    if dtype not in _STORAGE:
        raise TypeError(f"cannot record activations of dtype {dtype}; supported: {sorted(_BY_NAME)}")
    return _STORAGE[dtype][1]


def stored_values(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Receiver storage -> what the file holds (16-bit floats widen exactly to float32)."""
    if dtype == torch.bfloat16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    if dtype == torch.float16:
        return values.astype(np.float32)
    return values


def group_name(dtype: torch.dtype, hidden: int) -> str:
    """Files are grouped by activation shape: one width and captured dtype per file."""
    return f"{dtype_name(dtype)}x{hidden}"


def file_name(dtype: torch.dtype, hidden: int, index: int, ext: str) -> str:
    return f"{group_name(dtype, hidden)}-{index:05d}.{ext}"


def package_version() -> str:
    return probe.__version__  # written once, in probe/_version.py (the installed metadata reads it there too)


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
    act_meta = {"probebus.dtype": dtype_name(dtype), "probebus.hidden": str(hidden)}
    if dtype in _WIDENED:
        act_meta["probebus.storage"] = f"float32, widened exactly from the captured {dtype_name(dtype)}"
    return pa.schema(
        [*IDENTITY_FIELDS, pa.field("activation", pa.list_(value_type), nullable=False, metadata=act_meta)],
        metadata=meta,
    )


def activation_dtype(field: pa.Field) -> torch.dtype:
    """The captured torch dtype of an `activation` field (from its metadata; bf16/fp16 included)."""
    md = field.metadata or {}
    name = md.get(b"probebus.dtype")
    if name is not None and name != b"mixed":
        return torch_dtype(name.decode())
    value = field.type.value_type
    for d, (t, _) in _STORAGE.items():
        if t == value and d not in _WIDENED:
            return d
    raise ValueError(f"activation column of type {field.type} is not a probebus activation")


def activation_values(field: pa.Field, values: np.ndarray) -> np.ndarray:
    """Flat values of an activation column as float32 or wider (format 1 stored bf16 as uint16 bits)."""
    if values.dtype == np.uint16 and (field.metadata or {}).get(b"probebus.dtype") == b"bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values


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
    tmp = path.with_name(path.name + ".tmp")  # "_manifest.json.tmp": hidden from folder readers too
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
    """The manifest of a recording folder, None without one; ValueError (one line) for a manifest that is not
    one: not a regular file of the folder, over MANIFEST_MAX, not JSON, or a field of the wrong type."""
    p = Path(directory) / MANIFEST
    if not os.path.lexists(p) and (Path(directory) / LEGACY_MANIFEST).is_file():
        p = Path(directory) / LEGACY_MANIFEST
    try:
        man = json.loads(read_capped(p, MANIFEST_MAX).decode("utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{p} is not a valid probebus manifest: {str(exc)[:200]}") from None
    _check_manifest(man, p)
    return man


_MANIFEST_STRINGS = ("state", "model", "config_hash", "probebus_version", "file_format", "error", "interrupted_by",
                     "lost", "format", "endpoint", "started_at", "updated_at")
_ENTRY_LISTS = ("sites", "layers", "phases", "runs")


def _check_manifest(man: object, p: Path) -> None:
    """ValueError unless the fields readers use have their types (a crafted manifest gave tracebacks)."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{p} is not a valid probebus manifest: {what}; remove it (the data files read without it)")

    if not isinstance(man, dict):
        raise bad(f"a JSON {type(man).__name__}, not an object")
    for name in _MANIFEST_STRINGS:
        if man.get(name) is not None and not isinstance(man[name], str):
            raise bad(f"its {name!r} is a {type(man[name]).__name__}")
    for name in ("counts", "metadata", "last_written"):
        if man.get(name) is not None and not isinstance(man[name], dict):
            raise bad(f"its {name!r} is a {type(man[name]).__name__}")
    for name in ("files", "in_progress"):
        entries = man.get(name)
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise bad(f"its {name!r} is a {type(entries).__name__}")
        for e in entries:
            if not isinstance(e, dict) or not isinstance(e.get("name"), str):
                raise bad(f"an entry of {name!r} is not an object with a name")
            for k in _ENTRY_LISTS:
                want = int if k == "layers" else str
                if e.get(k) is not None and (not isinstance(e[k], list) or
                                             not all(isinstance(v, want) and not isinstance(v, bool) for v in e[k])):
                    raise bad(f"the entry of {e['name'][:80]!r} has a {k!r} that is not a list of {want.__name__}")
