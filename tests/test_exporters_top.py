"""`probebus top` you can find and that lets go: it lists live sessions, refuses an endpoint nobody
serves, exits when the session ends without spinning a core, and survives hostile frames;
`record --model --endpoint` binds where it is told and says so (issues 12.2/12.4, 13.3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from _exporters_helpers import ROOT, save_model_with_tokenizer, tiny_llama
from models import PAD, left_padded

import exporters
import probe
from probe import _wire
from probebus.cli import main as cli_main

IDS, MASK = left_padded([[5, 17, 33, 9], [40, 41, 42]])


def _generate(model: torch.nn.Module, n: int = 8) -> None:
    with torch.no_grad():
        model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=n, do_sample=False, pad_token_id=PAD)


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "runtime"
    monkeypatch.setenv("PROBEBUS_RUNTIME_DIR", str(d))
    return d


def test_top_without_endpoint_lists_live_sessions(runtime_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    model = tiny_llama(layers=2)
    with probe.attach(model, "layers.*.resid_post") as session:
        r = subprocess.run([sys.executable, "-m", "probebus", "top"], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert session.endpoint in r.stdout and "1 live probe session" in r.stdout
    r = subprocess.run([sys.executable, "-m", "probebus", "top"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "no live probe sessions" in r.stderr  # closed sessions are gone


def test_top_refuses_an_endpoint_nobody_serves(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    t0 = time.monotonic()
    assert cli_main(["top", f"ipc://{tmp_path}/typo.sock", "--wait", "1", "--json"]) == 2
    err = capsys.readouterr().err
    assert "nobody serves" in err and len(err.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 5
    assert cli_main(["top", "not-an-endpoint"]) == 2
    assert "is not an endpoint" in capsys.readouterr().err


def test_top_exits_when_the_session_ends(tmp_path: Path) -> None:
    """It used to keep running (17.2 s of CPU in 18.3 s) after the session closed."""
    model = tiny_llama(layers=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with probe.attach(model, "layers.*.resid_post") as session:
        proc = subprocess.Popen([sys.executable, "-m", "probebus", "top", session.endpoint, "--json", "--duration",
                                 "120", "--interval", "0.2"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        session.wait_for_subscribers(1, timeout=60)
        for _ in range(3):
            _generate(model)
    t_closed = time.monotonic()
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert time.monotonic() - t_closed < 15
    totals = json.loads(out)
    assert totals["ended"] and totals["captures"] == session.stats.published


def test_monitor_does_not_spin_after_the_end() -> None:
    model = tiny_llama(layers=2)
    with probe.attach(model, "layers.*.resid_post") as session:
        mon = exporters.TopMonitor(session.endpoint)
        session.wait_for_subscribers(1)
        _generate(model)
    deadline = time.monotonic() + 10
    while not mon.ended and time.monotonic() < deadline:
        mon.poll(0.1)
    assert mon.ended
    cpu0, t0 = time.process_time(), time.monotonic()
    for _ in range(20):
        mon.poll(1.0)  # returns at once: nothing more can come
    assert time.monotonic() - t0 < 1.0 and time.process_time() - cpu0 < 0.5
    totals = mon.totals()
    assert totals["captures"] == session.stats.published and totals["gaps"] == 0
    assert all(r["lag_s"] is not None and 0 <= r["lag_s"] < 5 for r in totals["sites"])  # sent_at on the wire
    mon.close()


def test_monitor_survives_odd_site_names(tmp_path: Path) -> None:
    """A publisher sending a well-formed capture under an odd name (layers.x.resid_post) crashed top."""
    endpoint = f"ipc://{tmp_path}/hostile.sock"
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(endpoint)
    mon = exporters.TopMonitor(endpoint)
    try:
        pub.recv(zmq.NOBLOCK) if pub.poll(5000) else pytest.fail("the monitor never subscribed")
        tokens = np.zeros((3, 1), np.int64).tobytes()
        payload = np.ones(4, np.float32).tobytes()
        frames = []
        for i, site in enumerate((b"layers.x.resid_post", b"layers.0.resid_post", b"layers.99999999999.a", b"")):
            frames.append(_wire.encode_envelope(b"r", site, 0, _wire.DTYPE_CODE[torch.float32], i, 0, 4, tokens,
                                                payload, seq=0))
        for f in frames * 3:
            pub.send(f)
        mon.poll(0.5)
        totals = mon.totals()
        assert [r["site"] for r in totals["sites"]] in ([], ["layers.0.resid_post"])
        assert totals["malformed"] >= 3  # the odd ones are counted, not raised
    finally:
        mon.close()
        pub.close(0)


def test_record_binds_the_endpoint_it_is_given_and_prints_it(tmp_path: Path) -> None:
    model_dir = save_model_with_tokenizer(tmp_path / "model")
    endpoint = f"ipc://{tmp_path}/record.sock"
    r = subprocess.run([sys.executable, "-m", "probebus", "record", "--model", str(model_dir), "--prompt", "def f(",
                        "--max-new-tokens", "3", "--endpoint", endpoint, "--out", str(tmp_path / "rec")],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"probe session {endpoint}" in r.stderr and f"probebus top {endpoint}" in r.stderr
    manifest = json.loads((tmp_path / "rec" / "_manifest.json").read_text())
    assert manifest["endpoint"] == endpoint and manifest["state"] == "complete"
    rec = exporters.read_recording(tmp_path / "rec")
    assert rec.prompt(0) == "def f(" and rec.cache(0).tokens[0]  # prompt text and token strings stored

