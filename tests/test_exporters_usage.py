"""Bad input on the command line: one clear line on stderr, exit status 2, nothing left on disk
(issue 12.10); offline by default (12.11); pipes, colours and working directories (13.5).

In-process (cli.main) where only the exit status and the message matter; a real process where
the property belongs to a process (a closed pipe, network traffic, the working directory)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _exporters_helpers import ROOT, save_model_with_tokenizer

from probebus.cli import main as cli_main


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "PROBEBUS_ONLINE"))}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _one_line_error(capsys: pytest.CaptureFixture, argv: list[str], *expect: str) -> str:
    code = cli_main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("probebus"), err
    for e in expect:
        assert e in err, err
    return err


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_with_tokenizer(tmp_path_factory.mktemp("m") / "model")


def test_record_bad_inputs_leave_nothing_behind(tmp_path: Path, tiny_model_dir: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "rec"
    base = ["record", "--model", str(tiny_model_dir), "--prompt", "def f(", "--out", str(out)]
    _one_line_error(capsys, [*base, "--max-new-tokens", "0"], "--max-new-tokens must be at least 1")
    _one_line_error(capsys, [*base, "--max-new-tokens", "-1"], "--max-new-tokens")
    _one_line_error(capsys, [*base, "--batch-size", "0"], "--batch-size must be at least 1")
    _one_line_error(capsys, [*base, "--rotate-mb", "0"], "--rotate-mb")
    assert not out.exists()  # no `recording` manifest left behind

    empty = tmp_path / "not-a-model"
    empty.mkdir()
    _one_line_error(capsys, ["record", "--model", str(empty), "--prompt", "x", "--out", str(out)],
                    "is not a model folder", "config.json")
    _one_line_error(capsys, ["record", "--model", str(tmp_path / "nope"), "--prompt", "x", "--out", str(out)],
                    "cannot find model")

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut in half
    _one_line_error(capsys, ["record", "--model", str(broken), "--prompt", "x", "--out", str(out)],
                    "cannot load the weights", "corrupt")

    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"def f(\n\xff\xfe not utf-8\n")
    _one_line_error(capsys, ["record", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out)],
                    "is not UTF-8")
    _one_line_error(capsys, ["record", "--model", str(tiny_model_dir), "--prompts", str(tmp_path / "missing.jsonl"),
                             "--out", str(out)], "no such file")
    _one_line_error(capsys, ["record", "--model", str(tiny_model_dir), "--prompt", "x", "--out", str(out),
                             "--device", "cuda:7"], "--device")
    _one_line_error(capsys, ["record", "--model", str(tiny_model_dir), "--prompt", "x", "--out", str(out),
                             "--sites", "layers.*.nonsense"], "nonsense")
    assert not (out / "_manifest.json").exists()


def test_record_endpoint_problems(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "rec"
    _one_line_error(capsys, ["record", "--endpoint", "nonsense", "--out", str(out)], "is not an endpoint")
    t0 = time.monotonic()
    _one_line_error(capsys, ["record", "--endpoint", f"ipc://{tmp_path}/nobody.sock", "--out", str(out)],
                    "nobody serves")
    assert time.monotonic() - t0 < 10
    assert not out.exists()


def test_record_into_an_existing_recording_says_overwrite(tmp_path: Path, tiny_model_dir: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "rec"
    out.mkdir()
    (out / "_manifest.json").write_text("{}")
    t0 = time.monotonic()
    _one_line_error(capsys, ["record", "--model", str(tiny_model_dir), "--prompt", "x", "--out", str(out)],
                    "--overwrite")
    assert time.monotonic() - t0 < 5  # refused before the model loads


def test_inspect_bad_paths(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["inspect", str(empty)], "holds no probebus recording")
    _one_line_error(capsys, ["inspect", str(tmp_path / "missing")], "no recording at")
    stray = tmp_path / "notes.txt"
    stray.write_text("hello")
    _one_line_error(capsys, ["inspect", str(stray)], "not a recording's data file")
    fake = tmp_path / "rec"
    fake.mkdir()
    (fake / "float32x64-00000.arrow").write_bytes(b"ARROW1\x00\x00" + b"\x00" * 40)  # a truncated file
    _one_line_error(capsys, ["inspect", str(fake)], "float32x64-00000.arrow", "truncated")
    _one_line_error(capsys, ["inspect", str(fake / "float32x64-00000.arrow")], "truncated")
    _one_line_error(capsys, ["top", "--interval", "0", "ipc:///x"], "must be positive")


def _proxy() -> tuple[str, list[bytes], socket.socket]:
    """A TCP listener posing as an HTTP(S) proxy: it records every connection any client makes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    seen: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                seen.append(conn.recv(200))
            except OSError:
                seen.append(b"")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", seen, srv


def test_offline_by_default_fails_fast_with_one_line(tmp_path: Path) -> None:
    """`probebus sites nonexistent-model-xyz` made 6 Hub requests and took 27 s. Every Hub request would go
    through the proxy below: none arrives, and the command answers in seconds. With --online it does go out
    (so this test can see traffic when there is some)."""
    url, seen, srv = _proxy()
    env = _env(HTTPS_PROXY=url, HTTP_PROXY=url, https_proxy=url, http_proxy=url, NO_PROXY="", no_proxy="",
               HF_HOME=str(tmp_path / "hf"))
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "probebus", "sites", "nonexistent-model-xyz"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "nonexistent-model-xyz" in r.stderr and "--online" in r.stderr and "Traceback" not in r.stderr
        assert seen == [] and took < 20
        r = subprocess.run([sys.executable, "-m", "probebus", "--online", "sites", "nonexistent-model-xyz"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert seen, "with --online the Hub is contacted (through the proxy)"
    finally:
        srv.close()


@pytest.fixture(scope="module")
def small_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from _exporters_helpers import tiny_llama
    from models import PAD, left_padded

    import exporters
    import probe

    out = tmp_path_factory.mktemp("small") / "rec"
    model = tiny_llama(layers=3)
    ids, mask = left_padded([[5, 17, 33, 9], [40, 41, 42]])
    with probe.attach(model, "layers.*.resid_pre,layers.*.resid_post,final_norm") as session:
        with exporters.ArrowRecorder(session, out):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    return out


def test_closed_pipe_and_no_ansi_and_any_working_directory(small_recording: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "probebus", "inspect", str(small_recording), "--json"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head` that already exited: every write now fails with EPIPE
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]
    assert proc.returncode == 141
    for args in (["inspect", str(small_recording)], ["sites", "default"]):  # piped: plain text, from /tmp
        r = subprocess.run([sys.executable, "-m", "probebus", *args], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "\x1b[" not in r.stdout + r.stderr
    assert "layers.0.resid_post" in r.stdout  # `default` resolved outside the repository


def test_inspect_plot_writes_pngs(small_recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    assert cli_main(["inspect", str(small_recording), "--plot", str(tmp_path / "plots"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] > 0
    for name in ("norms_by_position.png", "norms_by_layer.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
