"""Regression tests of issue 12 for the recorder: nothing hangs, signals finish the files.

Every test runs the real `probebus record` (its own process, real signals) or a real
probe session, and is bounded by subprocess timeouts.
"""

from __future__ import annotations

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
from _exporters_helpers import ROOT, FaultyFile, record_until_rows, tiny_llama
from models import PAD, left_padded

import exporters
import probe
from exporters import _files

DEFAULT = ROOT / "probebus" / "models" / "default"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def _long_prompts(path: Path, n: int = 8, tokens: int = 264) -> Path:
    """n prompts of at least `tokens` tokens each (the default tokenizer), as JSON Lines."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT)
    lines = []
    for i in range(n):
        text = f"def f{i}(x):\n    return x + {i}\n"
        while len(tok(text)["input_ids"]) < tokens:
            text += f"x{i} = f{i}(x{i} * {i})\n"
        lines.append(json.dumps({"prompt": text}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _assert_finished(out: Path) -> dict:
    """Files complete (strictly readable), no stream left in progress, manifest final."""
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["state"] == "complete", manifest
    assert not list(out.glob("*.inprogress")) and not list(out.glob("*.tmp"))
    rows = 0
    for entry in manifest["files"]:
        with pa.memory_map(str(out / entry["name"])) as src:
            rows += pa.ipc.open_file(src).read_all().num_rows
    assert rows == manifest["counts"]["rows"] > 0
    return manifest


_BIG_CAPTURE = """
import sys, time, torch, probe, exporters
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.randint(3, 8000, (8, 264), generator=torch.Generator().manual_seed(0))
with probe.attach(model, "layers.*.resid_post,logits") as session:
    # Default slab and memory sizes; a long flush age keeps the residual slab open when the logits arrive
    # (with the default 0.25 s the outcome depended on how fast this machine ran the forward).
    rec = exporters.ArrowRecorder(session, sys.argv[2], flush_seconds=30).start()
    with torch.no_grad():
        model(ids)            # logits [8, 264, 8192]: one 69 MB capture of a new shape
        model(ids[:, :8])
t0 = time.monotonic()
s = rec.stop(timeout=60)
print(s.rows, s.clean, s.dropped, round(time.monotonic() - t0, 2))
"""


def test_big_capture_of_a_new_shape_does_not_deadlock(tmp_path: Path) -> None:
    """Issue 12.1: logits of one 8 x 264 forward (69 MB) while a residual slab is open used to wait
    forever for slab memory that only the waiting receiver could free; stop() never returned."""
    out = tmp_path / "rec"
    try:
        r = subprocess.run([sys.executable, "-c", _BIG_CAPTURE, str(DEFAULT), str(out)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the recorder hung on a big capture of a new shape")
    assert r.returncode == 0, r.stderr[-3000:]
    rows, clean, dropped, _ = r.stdout.split()
    assert clean == "True" and dropped == "0"
    assert int(rows) == 9 * 8 * (264 + 8)  # 8 resid_post sites + logits, both forwards, every token
    manifest = _assert_finished(out)
    logits = [f for f in manifest["files"] if f["hidden"] == 8192]
    assert sum(f["rows"] for f in logits) == 8 * (264 + 8)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_files_and_manifest(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGINT/SIGTERM during generation: the command stops within seconds, with every file finished, and its
    status says so (one line, the signal named, as a person at the terminal reads it)."""
    out = tmp_path / "rec"
    proc = record_until_rows(out, tmp_path, _env())
    try:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert took < 20 and "Traceback" not in err
    status = [ln for ln in err.splitlines() if "status" in ln]
    assert len(status) == 1 and f"stopped by {sig.name}" in status[0] and "complete up to there" in status[0], err
    assert f"probebus record: stopped by {sig.name}" in err
    manifest = _assert_finished(out)
    assert manifest["interrupted"] is True
    assert exporters.read_recording(out).num_rows == manifest["counts"]["rows"]


class _HungFile(FaultyFile):
    """A sink whose writes block until released: a file system that stopped answering (simulated)."""

    release = threading.Event()

    def write(self, data: bytes) -> int:
        _HungFile.release.wait(120)
        return self.f.write(data)


def test_stop_returns_even_when_the_writer_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() used to join its threads without a timeout: a hung disk hung the caller forever."""
    monkeypatch.setattr(_files, "open_sink", lambda path: pa.PythonFile(_HungFile(path), mode="w"))
    model = tiny_llama(layers=2)
    ids, mask = left_padded([[5, 17, 33, 9], [40, 41, 42]])
    try:
        with probe.attach(model, "layers.*.resid_post", policy="best_effort") as session:
            rec = exporters.ArrowRecorder(session, tmp_path, flush_bytes=2048, flush_seconds=0.02).start()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               pad_token_id=PAD)
            time.sleep(0.3)  # the writer is now blocked in its first write
            t0 = time.monotonic()
            with pytest.warns(RuntimeWarning, match="did not finish"):
                summary = rec.stop(timeout=1.0, finish_timeout=2.0, raise_on_error=False)
            took = time.monotonic() - t0
    finally:
        _HungFile.release.set()  # let the abandoned thread go
    assert took < 10 and not summary.clean and "did not finish" in summary.error
    manifest = json.loads((tmp_path / "_manifest.json").read_text())
    assert manifest["state"] == "failed" and "did not finish" in manifest["error"]


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 192 KiB file system (tmpfs); needs the right to mount (root here), else the test is skipped."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_disk_full_leaves_a_failed_manifest_with_readable_rows(small_fs: Path) -> None:
    """A full disk used to leave state `recording` and a 0-byte manifest.json.tmp (now _manifest.json)."""
    model = tiny_llama(layers=2)
    ids, mask = left_padded([[5, 17, 33, 9], [40, 41, 42]])
    with probe.attach(model, "layers.*.resid_pre,layers.*.resid_post") as session:
        rec = exporters.ArrowRecorder(session, small_fs, flush_bytes=4096, flush_seconds=0.02).start()
        calls = 0
        with pytest.warns(RuntimeWarning, match="No space left on device"):
            while rec.running and calls < 100:
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                   pad_token_id=PAD)
                calls += 1
        assert not rec.running and calls < 100
        summary = rec.stop(raise_on_error=False)
    assert "No space left on device" in summary.error
    assert not list(small_fs.glob("*.tmp"))
    manifest = json.loads((small_fs / "_manifest.json").read_text())
    assert manifest["state"] == "failed" and "No space left" in manifest["error"]
    readable = exporters.read_recording(small_fs).num_rows
    assert 0 < readable == manifest["counts"]["rows"] == summary.rows
    assert exporters.recording_info(small_fs)["state"] == "failed"
