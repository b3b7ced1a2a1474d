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
def server(tmp_path: Path):
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
    with pytest.raises(RuntimeError, match="refusing"):  # a loopback server subscribes to this machine only
        server.connect("tcp://10.1.2.3:5555")


def test_decoder_does_not_import_probebus() -> None:
    code = ("import sys, decoder; bad = sorted(m for m in sys.modules if m.split('.')[0] == 'probebus'); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd="/")


def _free_port() -> int:
    import zmq

    sock = zmq.Context.instance().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    return port


def _own_address() -> str | None:
    """A non-loopback IPv4 address of this machine (a peer from there is not loopback), or None."""
    import socket

    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            if not info[4][0].startswith("127."):
                return info[4][0]
    except OSError:
        pass
    try:  # the address the route to a non-local one leaves from (UDP connect sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.254", 9))
            ip = s.getsockname()[0]
            return None if ip.startswith("127.") else ip
    except OSError:
        return None


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_serve_drafter_takes_no_orders_it_should_not(tmp_path: Path) -> None:
    """`serve-drafter` refuses a non-loopback address without --allow-remote (before loading anything); with it,
    a peer that is not this machine cannot stop it or point its subscriber anywhere, a message over the size limit
    drops only that client, and a prepare of absurd size, bad types and junk headers get error replies without the
    server allocating or dying."""
    import zmq

    port = _free_port()
    refused = subprocess.run([sys.executable, "-m", "probebus", "serve-drafter", "--bind", f"tcp://0.0.0.0:{port}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--allow-remote" in refused.stderr, refused.stderr[-2000:]
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]

    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "probebus", "serve-drafter", "--bind", f"tcp://0.0.0.0:{port}",
                                 "--allow-remote", "--max-message-mb", "1"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        local = None
        for _ in range(12):
            if proc.poll() is not None:
                break
            try:
                local = RemoteEagle(f"tcp://127.0.0.1:{port}", timeout=10)
                break
            except TimeoutError:
                continue
        assert local is not None, log.read_text()[-2000:]
        assert "open to anyone" in log.read_text()  # the warning for a remote bind without CURVE
        own = _own_address()
        if own is not None:  # a peer from this machine's own network address is not loopback: no exit, no subscribe
            remote = RemoteEagle(f"tcp://{own}:{port}", timeout=10)
            for op in ({"op": "exit"}, {"op": "subscribe", "endpoint": "tcp://127.0.0.1:1"}):
                with pytest.raises(RuntimeError, match="only from this machine or a CURVE client"):
                    remote._call(op)
            remote.sock.close(0)
        rss0 = _rss_mb(proc.pid)
        for header, match in (({"op": "subscribe", "endpoint": 5}, "'endpoint' must be"),
                              ({"op": "prepare", "batch": 2, "max_len": 8}, "before 'subscribe'"),
                              ({"op": ["exit"]}, "unknown op"),
                              ({"op": "prepare", "batch": "8", "max_len": 8}, "'batch' must be")):
            with pytest.raises(RuntimeError, match=match):
                local._call(header)
        local.connect(f"ipc://{tmp_path}/nobody")  # a loop that never comes: enough to prepare and draft
        with pytest.raises(RuntimeError, match="over this server's"):
            local.prepare(4096, 1 << 20)
        for header, match in (({"op": "draft", "k": -1, "temperature": 0.0, "seed": None}, "'k' must be"),
                              ({"op": "draft", "k": 3, "temperature": float("inf"), "seed": None}, "'temperature'"),
                              ({"op": "draft", "k": 3, "temperature": 0.0, "seed": None}, "4 int64 arrays")):
            with pytest.raises(RuntimeError, match=match):
                local._call(header)
        big = zmq.Context.instance().socket(zmq.REQ)  # 8 MiB, over the 1 MiB limit: this client is dropped
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"tcp://127.0.0.1:{port}")
        big.send_multipart([b'{"op": "hello"}', b"\0" * (8 << 20)])
        assert big.poll(3000) == 0  # no answer: the server dropped the connection
        big.close(0)
        local._call({"op": "hello"})  # and serves everyone else
        assert _rss_mb(proc.pid) - rss0 < 200, "the refused requests made the server allocate"
        local.shutdown()  # exit, from loopback: taken
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_drafter_with_curve_serves_only_its_listed_clients(tmp_path: Path) -> None:
    """`--allow-remote --curve-secret --curve-clients`: a listed client drafts (and may stop it, from anywhere);
    a client with another key gets no answer at all (the handshake is refused), and no warning is printed."""
    import zmq
    import zmq.auth

    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public, server_secret_file = zmq.auth.create_certificates(keys, "server")
    client_public_file, client_secret_file = zmq.auth.create_certificates(keys, "client")
    (clients / "client.key").write_bytes(Path(client_public_file).read_bytes())
    server_public = zmq.auth.load_certificate(server_public)[0]
    client = zmq.auth.load_certificate(client_secret_file)
    port = _free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "probebus", "serve-drafter", "--bind", f"tcp://0.0.0.0:{port}",
                                 "--allow-remote", "--curve-secret", str(server_secret_file), "--curve-clients",
                                 str(clients)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        listed = None
        for _ in range(12):
            if proc.poll() is not None:
                break
            try:
                listed = RemoteEagle(f"tcp://127.0.0.1:{port}", timeout=10, curve_server_key=server_public,
                                     curve_client_key=client)
                break
            except TimeoutError:
                continue
        assert listed is not None, log.read_text()[-2000:]
        assert listed.config.aux_layer_ids and "open to anyone" not in log.read_text()
        with pytest.raises(TimeoutError):
            RemoteEagle(f"tcp://127.0.0.1:{port}", timeout=3, curve_server_key=server_public)  # a one-off key
        listed.shutdown()  # a CURVE client may stop it
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
