"""Two sessions on one ipc:// path: ZeroMQ would let the second take the path from the first without a word (its
subscribers then hear nothing); the second is refused in one clear line. A stale socket file is reused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import probe
from probebus.models import resolve_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_tok() -> tuple[torch.nn.Module, object]:
    path = resolve_model("default")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_a_second_session_on_a_bound_ipc_path_is_refused(model_tok: tuple, tmp_path: Path) -> None:
    model, tok = model_tok
    endpoint = f"ipc://{tmp_path}/bus.sock"
    with probe.attach(model, "layers.0.resid_post", endpoint=endpoint) as first:
        sub = probe.Subscriber(endpoint)
        first.wait_for_subscribers(1)
        with pytest.raises(ValueError, match="another session .* is bound there"):
            probe.attach(model, "layers.1.resid_post", endpoint=endpoint)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        r = subprocess.run([sys.executable, "-m", "probebus", "record", "--model", "default", "--prompt", "x",
                            "--max-new-tokens", "2", "--sites", "layers.0.resid_post", "--endpoint", endpoint,
                            "--out", str(tmp_path / "rec")], env=env, capture_output=True, text=True, timeout=120)
        err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("Loading")]
        assert r.returncode == 2 and len(err) == 1 and "is bound there" in err[0], r.stderr
        with torch.no_grad():  # the first session still owns its path: its subscriber hears it
            model.generate(**tok(["import os\n"], return_tensors="pt"), max_new_tokens=2, do_sample=False)
    assert sum(1 for _ in sub) == 2  # prefill + one decode step


def test_a_stale_socket_file_or_a_plain_file(model_tok: tuple, tmp_path: Path) -> None:
    model, _ = model_tok
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens: what a crashed session leaves
    with probe.attach(model, "layers.0.resid_post", endpoint=f"ipc://{stale}") as session:
        assert session.endpoint == f"ipc://{stale}"
    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    with pytest.raises(ValueError, match="is not a socket"):
        probe.attach(model, "layers.0.resid_post", endpoint=f"ipc://{plain}")
    assert plain.read_text() == "mine"
