"""The drafter in another process: features over the bus, drafts back over REQ/REP. It must
draft exactly what the in-process drafter drafts (same acceptance), and stay lossless."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoder import RemoteEagle, SpeculativeDecoder, load_drafter
from probebus._code_prompts import code_prompts
from probebus._load import load_model, resolve_drafter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def server(tmp_path: Path):  # noqa: ANN201
    import zmq

    port = zmq.Context.instance().socket(zmq.REP)
    free = port.bind_to_random_port("tcp://127.0.0.1")
    port.close(0)
    address = f"tcp://127.0.0.1:{free}"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "probebus", "serve-drafter", "--bind", address], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    remote = None
    for _ in range(12):  # up to 2 minutes on a loaded machine, but fail at once if the server died
        if proc.poll() is not None:
            break
        try:
            remote = RemoteEagle(address, timeout=10)
            break
        except TimeoutError:
            continue
    if remote is None:
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"serve-drafter did not answer (exit {proc.returncode}): {log.read_text()[-2000:]}")
    yield remote
    remote.shutdown()
    proc.wait(30)


def test_remote_drafter_drafts_like_the_local_one(server: RemoteEagle) -> None:
    model, tok = load_model("default")
    enc = tok(code_prompts("heldout", 3, seed=5), return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model.generate(**enc, max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id)
    local = load_drafter(resolve_drafter("default"), model)
    results = {}
    for name, drafter, schedule in (("local", local, "fixed"), ("remote", server, "fixed"),
                                    ("remote scheduled", server, "auto")):  # the stopping rule travels too
        with SpeculativeDecoder(model, drafter, k=5, schedule=schedule) as spec:
            out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=32, pad_token_id=tok.pad_token_id)
        assert torch.equal(out.sequences, want), name
        results[name] = out.stats
    assert results["remote"].accepted_at == results["local"].accepted_at
    assert results["remote"].target_forwards == results["local"].target_forwards
    assert results["remote"].tau > 1.8


def test_remote_errors_are_reported_not_hung(server: RemoteEagle) -> None:
    with pytest.raises(RuntimeError, match="drafter server: RuntimeError: 'draft' before 'subscribe'"):
        server.draft([], torch.zeros(1, 4, dtype=torch.long), 3, 0.0, None)  # no loop connected yet
    with pytest.raises(RuntimeError, match="unknown op"):
        server._call({"op": "nonsense"})


def test_decoder_does_not_import_probebus() -> None:
    code = ("import sys, decoder; bad = sorted(m for m in sys.modules if m.split('.')[0] == 'probebus'); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd="/")
