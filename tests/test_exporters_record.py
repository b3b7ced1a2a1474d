"""ArrowRecorder on a batched, left-padded generate: every row equals the Subscriber's
capture and the oracle (output_hidden_states of a full unpadded forward), nothing more
and nothing less; bf16/fp16 are kept bit for bit; the reader's filters and helpers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet  # noqa: F401 - pa.parquet
import pytest
import torch
from _exporters_helpers import fed_tokens, oracle, tiny_llama
from models import PAD, left_padded

import exporters
import probe

PROMPTS = [[5, 17, 33, 9], [40, 41, 42, 43, 44, 45, 46], [7, 8]]
NEW = 6
SITES = ["layers.*.resid_pre", "layers.*.resid_post", "final_norm"]


def _record(model: torch.nn.Module, out: Path, fmt: str, **kw) -> tuple[dict, torch.Tensor, exporters.RecordingSummary]:
    """Generate with a recorder and a plain Subscriber attached; returns (captures by key, output ids, summary)."""
    ids, mask = left_padded(PROMPTS)
    with probe.attach(model, SITES) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with exporters.ArrowRecorder(session, out, format=fmt, **kw) as rec:
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                     pad_token_id=PAD)
        caps = {}
        for c in sub.iter(idle_timeout=0.5):
            for i in range(c.n_tokens):
                key = (c.step, c.site, int(c.seq_ids[i]), int(c.positions[i]))
                caps[key] = (int(c.token_ids[i]), c.tensor[i].clone(), c.phase, c.layer)
        sub.close()
    return caps, gen, rec.summary


@pytest.fixture(scope="module", params=["arrow", "parquet"])
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = tiny_llama(layers=3)
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():  # make row 0 emit EOS at its 3rd new token: finished-row stripping is exercised
        free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    model.generation_config.eos_token_id = int(free[0, ids.shape[1] + 2])
    out = tmp_path_factory.mktemp(f"rec-{request.param}")
    # Tiny flush and rotation sizes: many batches, several files, dictionary replacement across batches.
    caps, gen, summary = _record(model, out, request.param, flush_bytes=2048, rotate_bytes=12_000)
    return request.param, model, out, caps, gen, summary


def test_rows_equal_subscriber_and_oracle(recorded) -> None:
    fmt, model, out, caps, gen, summary = recorded
    stop = {int(model.generation_config.eos_token_id), PAD}
    width = max(map(len, PROMPTS))
    seqs = [fed_tokens(p, gen[b, width:].tolist(), stop) for b, p in enumerate(PROMPTS)]
    n_sites = len(probe.match_sites(model, SITES))
    # Row count = sum over steps of valid tokens x sites = every token each row really ran on, per site.
    expected_rows = sum(len(s) for s in seqs) * n_sites
    assert len(seqs[0]) == len(PROMPTS[0]) + 2  # row 0 finished early and its padding was not recorded
    table = exporters.read_recording(out)
    assert table.num_rows == expected_rows == len(caps) == summary.rows
    assert summary.clean and summary.dropped == 0 and summary.error is None
    oracles = [oracle(model, s) for s in seqs]
    d = table.to_pydict()
    acts = exporters.activations(table.filter(pa.compute.equal(table["site"].cast(pa.string()), "final_norm")))
    assert acts.tensor.shape == (sum(map(len, seqs)), 64)
    values = np.asarray(table.column("activation").combine_chunks().flatten()).reshape(-1, 64)
    seen = set()
    for i in range(table.num_rows):
        key = (d["step"][i], d["site"][i], d["seq_id"][i], d["position"][i])
        assert key not in seen
        seen.add(key)
        token, cap, phase, layer = caps[key]
        row = torch.from_numpy(values[i].copy())
        assert torch.equal(row, cap), key  # bit-identical to what the Subscriber received
        assert (d["token_id"][i], d["phase"][i], d["layer"][i]) == (token, phase, layer)
        seq, site, pos = d["seq_id"][i], d["site"][i], d["position"][i]
        assert seqs[seq][pos] == token
        if site in oracles[seq]:
            torch.testing.assert_close(row, oracles[seq][site][pos], rtol=1e-4, atol=1e-5)
    assert len({k[1] for k in seen}) == n_sites


def test_files_schema_and_manifest(recorded) -> None:
    fmt, model, out, caps, gen, summary = recorded
    names = sorted(p.name for p in out.iterdir())
    assert not [n for n in names if n.endswith((".inprogress", ".tmp"))]
    files = [n for n in names if n.endswith("." + fmt)]
    assert len(files) >= 2 and [Path(f).name for f in summary.files] == files  # rotated by size
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["state"] == "complete" and manifest["lost"] == "nothing"
    assert [f["name"] for f in manifest["files"]] == files
    assert sum(f["rows"] for f in manifest["files"]) == summary.rows
    assert manifest["config_hash"] and manifest["model"] == "llama"
    schema = exporters.read_recording(out, columns=["site"]).schema
    full = exporters.read_recording(out, sites="final_norm").schema
    for s in (schema, full):
        assert s.field("site").type == pa.dictionary(pa.int32(), pa.string())
    assert full.field("run").type == full.field("phase").type == pa.dictionary(pa.int32(), pa.string())
    act = full.field("activation")
    assert act.type == pa.list_(pa.float32())  # variable-size: files of every width share one schema
    assert act.metadata[b"probebus.dtype"] == b"float32"
    for f in out.glob(f"*.{fmt}"):  # each file still says its width
        file_schema = pa.ipc.open_file(str(f)).schema if fmt == "arrow" else pa.parquet.read_schema(f)
        assert file_schema.field("activation").metadata[b"probebus.hidden"] == b"64"
    meta = full.metadata
    assert meta[b"probebus.model"] == b"llama" and meta[b"probebus.config_hash"].decode() == manifest["config_hash"]
    assert meta[b"probebus.version"] and meta[b"probebus.format"] == b"probebus.recording"
    assert exporters.recording_info(out)["clean"]


def test_reader_filters_iteration_and_torch(recorded) -> None:
    fmt, model, out, caps, gen, summary = recorded
    full = exporters.read_recording(out)
    d = full.to_pydict()

    def count(pred) -> int:
        return sum(1 for i in range(full.num_rows) if pred(i))

    t = exporters.read_recording(out, sites="layers.1.*")
    assert set(t["site"].to_pylist()) == {"layers.1.resid_pre", "layers.1.resid_post"}
    assert t.num_rows == count(lambda i: d["site"][i].startswith("layers.1."))
    t = exporters.read_recording(out, layers=[0, 2], phase="decode")
    assert t.num_rows == count(lambda i: d["layer"][i] in (0, 2) and d["phase"][i] == "decode") > 0
    assert exporters.read_recording(out, phase="verify").num_rows == 0
    batches = list(exporters.iter_recording(out, sites="layers.*.resid_post", batch_rows=7))
    assert all(b.num_rows <= 7 for b in batches)
    assert sum(b.num_rows for b in batches) == count(lambda i: d["site"][i].endswith("resid_post"))
    reader = exporters.recording_reader(out, sites="final_norm")
    assert reader.read_all().num_rows == count(lambda i: d["site"][i] == "final_norm")
    dset = exporters.open_dataset(out)  # Arrow IPC files and Parquet alike
    assert dset.count_rows(filter=pa.dataset.field("layer") == 1) == count(lambda i: d["layer"][i] == 1)
    a = exporters.activations(out, site="layers.2.resid_pre")
    assert a.tensor.shape == (len(a), 64) and a.tensor.dtype == torch.float32
    for i in range(len(a)):
        key = (int(a.step[i]), "layers.2.resid_pre", int(a.seq_id[i]), int(a.position[i]))
        assert torch.equal(a.tensor[i], caps[key][1]) and int(a.token_id[i]) == caps[key][0]
    with pytest.raises(ValueError, match="pass site="):
        exporters.activations(out, layers=0)


@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, "arrow"), (torch.bfloat16, "parquet"),
                                       (torch.float16, "arrow")])
def test_half_precision_kept_exactly(dtype: torch.dtype, fmt: str, tmp_path: Path) -> None:
    model = tiny_llama(layers=2, dtype=dtype)
    caps, _, summary = _record(model, tmp_path, fmt)
    assert summary.rows == len(caps)
    field = exporters.read_recording(tmp_path, sites="final_norm").schema.field("activation")
    assert field.type.value_type == pa.float32()  # readers get floats; 16-bit floats widen exactly
    assert field.metadata[b"probebus.dtype"] == str(dtype).removeprefix("torch.").encode()
    for site in probe.match_sites(model, SITES):
        a = exporters.activations(tmp_path, site=site)
        assert a.tensor.dtype == dtype and len(a) > 0
        for i in range(len(a)):
            cap = caps[(int(a.step[i]), site, int(a.seq_id[i]), int(a.position[i]))][1]
            assert torch.equal(a.tensor[i].view(torch.int16), cap.view(torch.int16))  # same bits


def test_refuses_existing_recording_and_bad_arguments(tmp_path: Path) -> None:
    model = tiny_llama(layers=2)
    with probe.attach(model, "final_norm") as session:
        exporters.ArrowRecorder(session, tmp_path).start().stop()
        with pytest.raises(exporters.RecorderError, match="already holds a recording"):
            exporters.ArrowRecorder(session, tmp_path).start()
        exporters.ArrowRecorder(session, tmp_path, overwrite=True).start().stop()
        with pytest.raises(ValueError, match="format"):
            exporters.ArrowRecorder(session, tmp_path / "x", format="csv")
        with pytest.raises(probe.SiteError):
            exporters.ArrowRecorder(session, tmp_path / "x", sites="layers.*.nonsense")


def test_mixed_widths_group_files_and_filters_skip_files_unopened(tmp_path: Path) -> None:
    """Residuals (64 wide) and logits (vocab 128 wide) go to separate file groups; a site filter never
    opens the other group's files (proved by corrupting them), and an unfiltered read widens to list."""
    model = tiny_llama(layers=2)
    ids, mask = left_padded(PROMPTS)
    with probe.attach(model, ["layers.0.resid_post", "logits"]) as session:
        with exporters.ArrowRecorder(session, tmp_path, flush_bytes=4096, rotate_bytes=20_000):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               pad_token_id=PAD)
    x64, x128 = sorted(tmp_path.glob("float32x64-*.arrow")), sorted(tmp_path.glob("float32x128-*.arrow"))
    assert x64 and x128
    mixed = exporters.read_recording(tmp_path)
    assert pa.types.is_list(mixed.schema.field("activation").type)  # widths differ: variable-size list
    logits = exporters.activations(tmp_path, site="logits")
    assert logits.tensor.shape[1] == 128 and len(logits) > 0
    for f in x64:
        f.write_bytes(b"not arrow at all")
    again = exporters.activations(tmp_path, site="logits")  # manifest says these files hold no logits
    assert torch.equal(again.tensor, logits.tensor)
    with pytest.raises(pa.ArrowInvalid):
        exporters.read_recording(tmp_path, sites="layers.0.resid_post")
