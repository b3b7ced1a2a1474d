"""The recorder's files open as they are in DuckDB, polars and Hugging Face `datasets`,
and every library agrees with exporters.read_recording on counts and values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from _exporters_helpers import tiny_llama
from models import PAD, left_padded

import exporters
import probe

duckdb = pytest.importorskip("duckdb")
pl = pytest.importorskip("polars")
datasets = pytest.importorskip("datasets")

SITES = "layers.*.resid_post,final_norm"


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One generate recorded twice at once (Arrow and Parquet), plus a bf16 Arrow recording."""
    out = {}
    ids, mask = left_padded([[5, 17, 33, 9, 11], [40, 41, 42], [7, 8, 9, 10]])
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = tiny_llama(layers=3, dtype=dtype)
        with probe.attach(model, SITES) as session:
            recs = []
            for fmt in ("arrow", "parquet") if name == "fp32" else ("arrow",):
                path = out[f"{name}-{fmt}"] = tmp_path_factory.mktemp(f"{name}-{fmt}")
                recs.append(exporters.ArrowRecorder(session, path, format=fmt, flush_bytes=4096,
                                                    rotate_bytes=16_000).start())
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
            session.close()  # end of stream: the recorders hold everything
            for r in recs:
                assert r.stop().clean
    return out


def _reference(path: Path) -> tuple[dict[str, int], np.ndarray, pa.Table]:
    t = exporters.read_recording(path)
    sites = t.column("site").cast(pa.string()).to_pylist()
    counts = {s: sites.count(s) for s in set(sites)}
    values = np.asarray(t.column("activation").combine_chunks().flatten()).reshape(t.num_rows, -1)
    return counts, values, t


def _files(path: Path, ext: str) -> list[str]:
    files = sorted(str(p) for p in path.glob(f"*.{ext}"))
    assert len(files) >= 2  # several rotated files, all complete
    return files


def test_duckdb_reads_parquet_and_arrow_streams(recordings: dict[str, Path]) -> None:
    con = duckdb.connect()
    for key in ("fp32-parquet", "fp32-arrow", "bf16-arrow"):
        path = recordings[key]
        counts, values, ref = _reference(path)
        if key.endswith("parquet"):
            con.sql(f"CREATE OR REPLACE VIEW rel AS SELECT * FROM read_parquet('{path}/*.parquet')")
        else:  # no read_arrow offline: DuckDB scans each IPC stream through pyarrow's memory-mapped reader
            parts = []
            for i, f in enumerate(_files(path, "arrow")):
                con.register(f"part{i}", pa.ipc.open_stream(pa.memory_map(f)).read_all())
                parts.append(f"SELECT * FROM part{i}")
            con.sql("CREATE OR REPLACE VIEW rel AS " + " UNION ALL ".join(parts))
        got = dict(con.sql("SELECT site, count(*) FROM rel GROUP BY site").fetchall())
        assert got == counts
        rows = con.sql("SELECT step, site, seq_id, position, activation FROM rel").fetchall()
        index = {(s, site, q, p): i for i, (s, site, q, p) in enumerate(zip(
            ref["step"].to_pylist(), ref["site"].cast(pa.string()).to_pylist(), ref["seq_id"].to_pylist(),
            ref["position"].to_pylist(), strict=True))}
        assert len(rows) == len(index) == ref.num_rows
        for step, site, seq, pos, act in rows:
            assert np.array_equal(np.asarray(act, dtype=values.dtype), values[index[(step, site, seq, pos)]])


def test_polars_reads_files_directly(recordings: dict[str, Path]) -> None:
    for key in ("fp32-parquet", "fp32-arrow", "bf16-arrow"):
        path = recordings[key]
        counts, values, ref = _reference(path)
        if key.endswith("parquet"):
            df = pl.scan_parquet(f"{path}/*.parquet").collect()
        else:
            df = pl.concat([pl.read_ipc_stream(f) for f in _files(path, "arrow")])
        got = dict(df.group_by("site").len().iter_rows())
        assert {str(k): v for k, v in got.items()} == counts
        assert df.schema["activation"] == pl.Array(pl.Float32 if key.startswith("fp32") else pl.UInt16, 64)
        acts = df["activation"].to_numpy()
        assert np.array_equal(acts, values)  # same files in the same order: identical rows
        assert df["seq_id"].to_list() == ref["seq_id"].to_pylist()
        if key.startswith("bf16"):  # raw bf16 bits: a bit reinterpretation gives the recorded tensor back
            site = "layers.1.resid_post"
            bits = df.filter(pl.col("site") == site)["activation"].to_numpy()
            t = torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
            a = exporters.activations(path, site=site)
            assert a.tensor.dtype == torch.bfloat16 and torch.equal(t, a.tensor)


def test_hf_datasets_reads_arrow_and_parquet(recordings: dict[str, Path], tmp_path: Path) -> None:
    for key in ("fp32-arrow", "fp32-parquet", "bf16-arrow"):
        path = recordings[key]
        counts, values, ref = _reference(path)
        ext = "parquet" if key.endswith("parquet") else "arrow"
        files = _files(path, ext)
        if ext == "arrow":  # memory-mapped as they are: HF's own cache files are Arrow IPC streams
            parts = [datasets.Dataset.from_file(f) for f in files]
            ds = datasets.concatenate_datasets(parts)
        else:
            ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / key))
        assert ds.num_rows == ref.num_rows
        sites = ds["site"]
        assert {s: list(sites).count(s) for s in set(sites)} == counts
        feat = ds.features["activation"]
        assert feat.length == 64
        acts = ds.with_format("numpy")["activation"]
        assert np.array_equal(np.asarray(acts), values)
        assert ds[3]["position"] == ref["position"][3].as_py()
    # The generic builder too: load_dataset("arrow") on the recording's complete files.
    ds = datasets.load_dataset("arrow", data_files=_files(recordings["fp32-arrow"], "arrow"), split="train",
                               cache_dir=str(tmp_path / "builder"))
    assert ds.num_rows == exporters.read_recording(recordings["fp32-arrow"]).num_rows
