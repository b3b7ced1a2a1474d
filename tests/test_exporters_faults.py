"""Failures: a recorder killed with SIGKILL (its own process, a real signal), a directory
that is or becomes unwritable (real), a full disk (the one simulated fault), drop counting."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from _exporters_helpers import ROOT, FaultyFile, tiny_llama
from models import PAD, left_padded

import exporters
import probe
from exporters import _files
from exporters._gaps import GapCounter
from exporters._safe import RecordingError

IDS, MASK = left_padded([[5, 17, 33, 9], [40, 41, 42, 43, 44, 45, 46], [7, 8]])


def _generate(model: torch.nn.Module, n: int = 12) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=PAD)


class _Collector(threading.Thread):
    """A plain Subscriber draining in the background: the ground truth, in publish order."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.sub = probe.Subscriber(endpoint)
        self.order: list[tuple[int, str]] = []
        self.rows: dict[tuple[int, str, int, int], torch.Tensor] = {}

    def run(self) -> None:
        for c in self.sub:  # until end of stream
            self.order.append((c.step, c.site))
            for i in range(c.n_tokens):
                self.rows[(c.step, c.site, int(c.seq_ids[i]), int(c.positions[i]))] = c.tensor[i].clone()


def _check_rows_are_a_prefix(table: pa.Table, truth: _Collector) -> None:
    d = table.to_pydict()
    got = set()
    for i in range(table.num_rows):
        key = (d["step"][i], d["site"][i], d["seq_id"][i], d["position"][i])
        vals = torch.tensor(d["activation"][i], dtype=torch.float32)
        assert torch.equal(vals, truth.rows[key]), key
        got.add(key[:2])
    # Everything written is exactly the first K captures published: no hole in the middle.
    assert got == set(truth.order[: len(got)])


def test_sigkill_leaves_flushed_batches_readable(tmp_path: Path) -> None:
    model = tiny_llama(layers=2)
    out = tmp_path / "rec"
    # Files of several 0.25 s batches each (at ~150 KB per batch here), so that a half-written file exists.
    cmd = [sys.executable, "-m", "probebus", "record", "--endpoint", "", "--out", str(out), "--rotate-mb", "0.6"]
    with probe.attach(model, "layers.*.resid_post", policy="complete") as session:
        truth = _Collector(session.endpoint)
        truth.start()
        cmd[cmd.index("--endpoint") + 1] = session.endpoint
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            session.wait_for_subscribers(2, timeout=120)
            killed = threading.Event()

            def killer() -> None:  # kill mid-generation, once files rotated and a stream is half written
                while not killed.is_set():
                    # The manifest is rewritten at most every 0.5 s, so on a fast machine it may never show a
                    # half-written stream: look at the stream file itself for flushed batches.
                    try:
                        m = json.loads((out / "_manifest.json").read_text())
                        streams = [p for p in out.glob("*.inprogress") if p.stat().st_size > 8192]
                    except (OSError, ValueError):  # a file renamed under us: look again
                        m, streams = {}, []
                    if len(m.get("files", [])) >= 2 and streams:
                        os.kill(proc.pid, signal.SIGKILL)
                        killed.set()
                    time.sleep(0.02)

            threading.Thread(target=killer, daemon=True).start()
            calls = 0
            while not killed.is_set() and calls < 300:
                _generate(model)
                calls += 1
            assert killed.is_set(), "the recorder never rotated a file"
            for _ in range(3):  # the observed model is unaffected by its subscriber's death
                assert _generate(model).shape[1] == IDS.shape[1] + 12
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    truth.join(30)
    assert proc.returncode == -signal.SIGKILL
    assert session.stats.dropped == 0 and session.stats.published == session.stats.captured

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["state"] == "recording" and "killed" in manifest["lost"]
    for entry in manifest["files"]:  # every complete file reads strictly and holds what the manifest says
        table = pa.ipc.open_file(pa.memory_map(str(out / entry["name"]))).read_all()
        assert table.num_rows == entry["rows"] > 0
    complete = sorted(out.glob("*.arrow"))
    for f in complete:
        pa.ipc.open_file(pa.memory_map(str(f))).read_all()
    info = exporters.recording_info(out)
    assert not info["clean"] and info["state"] == "recording"
    assert info["partial_files"] and info["salvaged_rows"] >= sum(f["rows"] for f in manifest["in_progress"])
    table = exporters.read_recording(out)  # complete files + every flushed batch of the killed stream
    assert table.num_rows >= manifest["counts"]["rows"]
    assert table.num_rows < len(truth.rows)  # the kill really lost the tail
    _check_rows_are_a_prefix(table, truth)


def test_unwritable_directory_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = tiny_llama(layers=2)
    targets = [blocker / "rec"]  # ENOTDIR, for root as for anyone
    if Path("/sys").is_dir():
        targets.append(Path("/sys"))  # an existing directory where even root cannot create files (EACCES)
    with probe.attach(model, "final_norm") as session:
        for target in targets:
            with pytest.raises(exporters.RecorderError, match="cannot record into") as ei:
                exporters.ArrowRecorder(session, target).start()
            assert "pick a writable directory" in str(ei.value)
        assert _generate(model).shape[1] == IDS.shape[1] + 12  # the model never noticed


def test_directory_lost_mid_recording_stops_cleanly_model_keeps_generating(tmp_path: Path) -> None:
    model = tiny_llama(layers=2)
    out, moved = tmp_path / "rec", tmp_path / "moved"
    with probe.attach(model, "layers.*.resid_post", policy="complete") as session:
        rec = exporters.ArrowRecorder(session, out, rotate_bytes=6000, flush_bytes=1024, flush_seconds=0.02).start()
        _generate(model)
        deadline = time.monotonic() + 10
        while not list(out.glob("*.arrow")) and time.monotonic() < deadline:
            time.sleep(0.02)
        calls = 0
        # The recorder thread may fail (and warn) at once, so the rename happens inside the capture.
        # ENOTDIR for a new file under `out`; ENOENT if the writer was renaming its stream at that instant
        lost = "Not a directory|No such file or directory"
        with pytest.warns(RuntimeWarning, match=lost):
            out.rename(moved)  # files already open keep working; every new file or rename now fails for real
            out.write_text("this used to be the recording directory")
            while rec.running and calls < 50:
                assert _generate(model).shape[1] == IDS.shape[1] + 12  # `complete` never blocks on a dead recorder
                calls += 1
        assert not rec.running
        for _ in range(3):
            assert _generate(model).shape[1] == IDS.shape[1] + 12
        with pytest.raises(exporters.RecorderError, match=lost) as ei:
            rec.stop()
    summary = ei.value.summary
    assert summary is not None and summary.error and not summary.clean and summary.rows > 0
    assert "the observed model was not affected" in summary.error
    assert exporters.read_recording(moved).num_rows == summary.rows  # all it wrote is still readable
    assert session.stats.dropped == 0


class _FullDisk(FaultyFile):
    """The only simulated fault: a file whose writes fail with ENOSPC once a byte budget is spent."""

    budget = 0

    def write(self, data: bytes) -> int:
        if _FullDisk.budget < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _FullDisk.budget -= len(data)
        return self.f.write(data)


def test_disk_full_clear_error_and_written_rows_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _FullDisk.budget = 30_000
    monkeypatch.setattr(_files, "open_sink", lambda path: pa.PythonFile(_FullDisk(path), mode="w"))
    model = tiny_llama(layers=2)
    with probe.attach(model, "layers.*.resid_post") as session:
        truth = _Collector(session.endpoint)
        truth.start()
        session.wait_for_subscribers(1)
        rec = exporters.ArrowRecorder(session, tmp_path, flush_bytes=2048, flush_seconds=0.02).start()
        calls = 0
        with pytest.warns(RuntimeWarning, match="No space left on device"):
            while rec.running and calls < 50:
                assert _generate(model).shape[1] == IDS.shape[1] + 12
                calls += 1
        assert not rec.running and calls < 50
        assert _generate(model).shape[1] == IDS.shape[1] + 12
        summary = rec.stop(raise_on_error=False)
    truth.join(30)
    assert "No space left on device" in summary.error and summary.unwritten > 0
    table = exporters.read_recording(tmp_path)  # the in-progress stream, up to the failed write
    assert 0 < table.num_rows == summary.rows
    _check_rows_are_a_prefix(table, truth)
    assert json.loads((tmp_path / "_manifest.json").read_text())["state"] == "failed"


def test_gap_counter_finds_a_site_that_skipped_a_step() -> None:
    g = GapCounter()
    for step in range(1, 6):
        for site in ("a", "b", "c"):
            if (step, site) not in {(2, "b"), (3, "b"), (4, "c")}:  # what best_effort dropped
                g.observe("r", step, site)
    g.observe("r2", 9, "a")  # another run starts fresh
    assert g.total == 3 and dict(g.by_site) == {"b": 2, "c": 1}


def test_repair_makes_a_killed_recorders_rows_visible_to_every_reader(tmp_path: Path) -> None:
    """After `kill -9` of a recorder whose file never rotated, pyarrow.dataset and polars saw 0 rows (the stream is an
    in-progress file without a footer); `probebus inspect --repair` finishes it, after which they see exactly the
    rows `read_recording` salvaged, and the manifest lists the file. A second repair has nothing to do."""
    import polars as pl
    import pyarrow.dataset as ds

    model = tiny_llama(layers=2)
    out = tmp_path / "rec"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with probe.attach(model, "layers.*.resid_post", policy="complete") as session:
        proc = subprocess.Popen([sys.executable, "-m", "probebus", "record", "--endpoint", session.endpoint, "--out",
                                 str(out)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            session.wait_for_subscribers(1, timeout=120)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # until whole batches are in the stream (flushed every 0.25 s)
                _generate(model)
                streams = [p for p in out.glob("*.inprogress") if p.stat().st_size > 8192]
                if streams:
                    time.sleep(0.6)  # the batch being written, and the manifest that lists the stream
                    break
            assert streams, "the recorder never flushed a batch"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    salvaged = exporters.read_recording(out).num_rows
    assert salvaged > 0 and not list(out.glob("*.arrow"))
    assert ds.dataset(str(out), format="ipc").count_rows() == 0  # what third-party readers saw

    with pytest.raises(RecordingError, match="may still be running"):
        exporters.repair_recording(out)  # written moments ago under a manifest saying recording: maybe live
    old = os.stat(streams[0]).st_mtime - 60
    for f in out.glob("*.inprogress"):
        os.utime(f, (old, old))
    res = subprocess.run([sys.executable, "-m", "probebus", "inspect", str(out), "--repair", "--json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "repaired:" in res.stderr and json.loads(res.stdout)["rows"] == salvaged
    assert not list(out.glob("*.inprogress"))
    assert ds.dataset(str(out), format="ipc").count_rows() == salvaged
    assert pl.scan_ipc(str(out / "*.arrow")).select(pl.len()).collect().item() == salvaged
    assert exporters.read_recording(out).num_rows == salvaged
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["state"] == "repaired" and not manifest["in_progress"]
    assert sum(f["rows"] for f in manifest["files"]) == salvaged
    assert exporters.repair_recording(out) == []
