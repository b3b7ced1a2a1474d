"""Recordings open as they are in DuckDB, polars, pyarrow (dataset, feather) and Hugging Face
`datasets`, including a recording that mixes widths (residuals and logits) and a bf16 one;
every library agrees with exporters' own reader; docs/reading.md's snippets run as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.feather as feather
import pytest
import torch
from _exporters_helpers import ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

import exporters
import probe

duckdb = pytest.importorskip("duckdb")
pl = pytest.importorskip("polars")
datasets = pytest.importorskip("datasets")

DEFAULT = ROOT / "probebus" / "models" / "default"
SITES = "layers.*.resid_post,logits"
BATCHES = [["def add(a, b):\n", "import os\n", "class Stack:\n    def push(self, item):\n"], ["x = 1\n"]]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default model recorded at once to Arrow and Parquet (fp32), and again to Arrow in bf16."""
    tok = AutoTokenizer.from_pretrained(DEFAULT)
    tok.padding_side = "left"
    out: dict[str, Path] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(DEFAULT, dtype=dtype).eval()
        with probe.attach(model, SITES) as session:
            recs = []
            for fmt in ("arrow", "parquet") if name == "fp32" else ("arrow",):
                path = out[f"{name}-{fmt}"] = tmp_path_factory.mktemp(f"{name}-{fmt}") / "rec"
                recs.append(exporters.ArrowRecorder(session, path, format=fmt, tokenizer=tok, flush_bytes=64 << 10,
                                                    rotate_bytes=400_000).start())
            seq = 0
            for prompts in BATCHES:
                enc = tok(prompts, return_tensors="pt", padding=True)
                with torch.no_grad():
                    model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
                for r in recs:
                    r.add_prompts(prompts, list(range(seq, seq + len(prompts))))
                seq += len(prompts)
            session.close()  # end of stream: the recorders hold everything
            for r in recs:
                assert r.stop().clean
    return out


def _reference(path: Path) -> tuple[dict[str, int], dict[tuple, np.ndarray]]:
    t = exporters.read_recording(path)
    sites = t.column("site").cast(pa.string()).to_pylist()
    counts = {s: sites.count(s) for s in set(sites)}
    d = t.to_pydict()
    rows = {(d["step"][i], d["site"][i], d["seq_id"][i], d["position"][i]): np.asarray(d["activation"][i], np.float32)
            for i in range(t.num_rows)}
    return counts, rows


def _check(rows: list[tuple], ref: dict[tuple, np.ndarray]) -> None:
    assert len(rows) == len(ref)
    for step, site, seq, pos, act in rows:
        assert np.array_equal(np.asarray(act, np.float32), ref[(step, site, seq, pos)])


def test_files_and_widths(recordings: dict[str, Path]) -> None:
    path = recordings["fp32-arrow"]
    names = sorted(p.name for p in path.iterdir())
    assert "_manifest.json" in names and "_prompts.jsonl" in names
    widths = {int(re.match(r"float32x(\d+)-", n)[1]) for n in names if n.endswith(".arrow")}
    assert widths == {192, 8192}  # residuals and logits: two file groups, one schema
    for f in path.glob("*.arrow"):
        with pa.memory_map(str(f)) as src:
            assert pa.ipc.open_file(src).schema.field("activation").type == pa.list_(pa.float32())


def test_duckdb(recordings: dict[str, Path]) -> None:
    for key in ("fp32-arrow", "fp32-parquet", "bf16-arrow"):
        path = recordings[key]
        counts, ref = _reference(path)
        if key.endswith("parquet"):
            rel = duckdb.sql(f"SELECT * FROM '{path}/*.parquet'")
        else:
            rec = pds.dataset(str(path), format="ipc")  # noqa: F841 - DuckDB finds it by name
            rel = duckdb.sql("SELECT * FROM rec")
        assert dict(rel.aggregate("site, count(*)").fetchall()) == counts
        _check(rel.select("step, site, seq_id, position, activation").fetchall(), ref)


def test_polars(recordings: dict[str, Path]) -> None:
    for key in ("fp32-arrow", "fp32-parquet", "bf16-arrow"):
        path = recordings[key]
        counts, ref = _reference(path)
        df = pl.scan_parquet(f"{path}/*.parquet").collect() if key.endswith("parquet") else \
            pl.scan_ipc(f"{path}/*.arrow").collect()
        assert {str(k): v for k, v in df.group_by("site").len().iter_rows()} == counts
        assert df.schema["activation"] == pl.List(pl.Float32)  # bf16 included: floats, not raw bits
        _check(list(df.select("step", "site", "seq_id", "position", "activation").iter_rows()), ref)
        one = sorted(path.glob("*.arrow" if key.endswith("arrow") else "*.parquet"))[0]
        single = pl.read_ipc(one) if key.endswith("arrow") else pl.read_parquet(one)
        assert single.height > 0


def test_pyarrow_dataset_and_feather(recordings: dict[str, Path]) -> None:
    for key in ("fp32-arrow", "bf16-arrow", "fp32-parquet"):
        path = recordings[key]
        counts, ref = _reference(path)
        dset = pds.dataset(str(path), format="parquet" if key.endswith("parquet") else "ipc")
        t = dset.to_table()
        assert t.num_rows == sum(counts.values())
        d = t.to_pydict()
        _check(list(zip(d["step"], d["site"], d["seq_id"], d["position"], d["activation"], strict=True)), ref)
        if key.endswith("arrow"):
            assert sum(feather.read_table(f).num_rows for f in dset.files) == t.num_rows


def test_hf_datasets_mixed_widths(recordings: dict[str, Path], tmp_path: Path) -> None:
    for key in ("fp32-arrow", "bf16-arrow", "fp32-parquet"):
        path = recordings[key]
        counts, ref = _reference(path)
        ext = "parquet" if key.endswith("parquet") else "arrow"
        ds = datasets.load_dataset(ext, data_files=f"{path}/*.{ext}", split="train", cache_dir=str(tmp_path / key))
        assert ds.num_rows == sum(counts.values())
        sites = ds["site"]
        assert {s: list(sites).count(s) for s in set(sites)} == counts
        _check([(r["step"], r["site"], r["seq_id"], r["position"], r["activation"]) for r in ds], ref)


def test_bf16_reads_as_the_captured_values(recordings: dict[str, Path]) -> None:
    """bf16 captures are float32 on disk (exact), and come back as bf16 tensors from probebus' reader."""
    path = recordings["bf16-arrow"]
    t = exporters.read_recording(path, sites="layers.2.resid_post")
    assert t.schema.field("activation").type == pa.list_(pa.float32())
    assert t.schema.field("activation").metadata[b"probebus.dtype"] == b"bfloat16"
    a = exporters.activations(path, site="layers.2.resid_post")
    assert a.tensor.dtype == torch.bfloat16
    flat = np.array(t.column("activation").combine_chunks().flatten()).reshape(len(a), -1)
    assert torch.equal(a.tensor.float(), torch.from_numpy(flat))  # widening was exact: no value changed
    assert torch.equal(torch.from_numpy(flat).to(torch.bfloat16).float(), torch.from_numpy(flat))


def _snippets() -> list[str]:
    """Every ```python block of docs/*.md and README.md whose first line starts with '# read rec/' (the others run in
    tests/test_examples.py)."""
    out = []
    for doc in (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"):
        if doc.is_file():
            out += [b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S) if b.startswith("# read rec/")]
    return out


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_doc_snippets_run_as_printed(index: int, recordings: dict[str, Path], tmp_path: Path) -> None:
    code = _snippets()[index]
    key = "fp32-parquet" if ".parquet" in code else "fp32-arrow"
    (tmp_path / "rec").symlink_to(recordings[key], target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"snippet failed:\n{code}\n{r.stderr[-3000:]}"
    assert r.stdout.strip()  # every snippet shows something
