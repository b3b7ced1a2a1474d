"""CURVE: a session that leaves the machine is encrypted, and can admit only the clients it lists.

Real TCP sockets on loopback; the admitted recorder runs in another process through the CLI, with
certificate files as `zmq.auth.create_certificates` writes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from models import build

import exporters
import probe
from probe._hooks import tapped
from probebus.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[5, 6, 7, 8, 9]])

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")


def _hidden(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(IDS, output_hidden_states=True).hidden_states


def test_only_listed_clients_read_and_they_read_every_value() -> None:
    """With `curve_clients`, a subscriber that knows the server's key but is not listed, and one without
    CURVE, get nothing and do not count as subscribers; the listed one gets the oracle's values, bit-exact."""
    model = build("llama")
    hidden = _hidden(model)
    server_pub, server_sec = zmq.curve_keypair()
    me_pub, me_sec = zmq.curve_keypair()
    with probe.attach(model, "layers.*.resid_post", endpoint="tcp://127.0.0.1:*", curve_secret_key=server_sec,
                      curve_clients=[me_pub]) as session:
        stranger = probe.Subscriber(session.endpoint, curve_server_key=server_pub)  # a one-off key pair
        plain = probe.Subscriber(session.endpoint)
        me = probe.Subscriber(session.endpoint, curve_server_key=server_pub.decode(),
                              curve_client_key=(me_pub.decode(), me_sec))  # text or bytes alike
        session.wait_for_subscribers(1, timeout=10)
        with pytest.raises(TimeoutError):
            session.wait_for_subscribers(2, timeout=1.0)
        with torch.no_grad():
            model(IDS)
    caps = list(me.iter(idle_timeout=10))
    assert me.ended and [c.site for c in caps] == [f"layers.{i}.resid_post" for i in range(len(hidden) - 1)]
    for i, cap in enumerate(caps[:-1]):  # transformers' last hidden state is after the final norm
        assert torch.equal(cap.tensor, hidden[i + 1][0])
    for sub in (stranger, plain):
        assert list(sub.iter(idle_timeout=0.5)) == [] and not sub.ended and sub.stats.received == 0
        sub.close()
    me.close()


@pytest.mark.parametrize("listed", [False, True])
def test_a_recorder_on_its_own_curve_session_takes_the_session_keys(tmp_path: Path, listed: bool) -> None:
    """An in-process recorder given the session itself finds the server's key there, and with an allowlist
    the client key the session admits for its own process."""
    model = build("llama")
    hidden = _hidden(model)
    public, secret = zmq.curve_keypair()
    clients = [zmq.curve_keypair()[0]] if listed else None
    with probe.attach(model, "layers.1.resid_post", endpoint="tcp://127.0.0.1:*", curve_secret_key=secret,
                      curve_clients=clients) as session:
        assert session.curve_public_key == public and (session.curve_local_client is not None) == listed
        with exporters.ArrowRecorder(session, tmp_path / "rec"):
            with torch.no_grad():
                model(IDS)
    t = exporters.read_recording(tmp_path / "rec")
    assert torch.equal(torch.tensor(t["activation"].to_pylist()), hidden[2][0])


def test_cli_records_a_curve_session_in_another_process(tmp_path: Path) -> None:
    """`probebus record --endpoint --curve-server --curve-client` from certificate files; a folder of public
    certificates is the allowlist."""
    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    zmq.auth.create_certificates(keys, "server")
    public, _ = zmq.auth.create_certificates(keys, "me")
    Path(public).rename(clients / "me.key")
    _, server_sec = zmq.auth.load_certificate(keys / "server.key_secret")
    model = build("llama")
    hidden = _hidden(model)
    out = tmp_path / "rec"
    with probe.attach(model, "layers.0.resid_post", endpoint="tcp://127.0.0.1:*", curve_secret_key=server_sec,
                      curve_clients=clients) as session:
        proc = subprocess.Popen([sys.executable, "-m", "probebus", "record", "--endpoint", session.endpoint,
                                 "--out", str(out), "--json", "--curve-server", str(keys / "server.key"),
                                 "--curve-client", str(keys / "me.key_secret")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        session.wait_for_subscribers(1, timeout=120)
        with torch.no_grad():
            model(IDS)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout)["captures"] == 1
    t = exporters.read_recording(out)
    assert t.num_rows == IDS.shape[1] and t["position"].to_pylist() == list(range(IDS.shape[1]))
    got = torch.tensor(t["activation"].to_pylist())
    assert torch.equal(got, hidden[1][0])


def test_bad_keys_are_clear_errors_and_leave_nothing_attached(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    model = build("llama")
    _, secret = zmq.curve_keypair()
    cases = [
        ({"curve_secret_key": b"too short"}, "curve_secret_key must be a CURVE key"),
        ({"curve_secret_key": "~" * 40}, "curve_secret_key must be a CURVE key"),  # not Z85
        ({"curve_clients": [b"x" * 40]}, "curve_clients needs curve_secret_key"),
        ({"curve_secret_key": secret, "curve_clients": [b"nope"]}, "each of curve_clients must be a CURVE key"),
        ({"curve_secret_key": secret, "curve_clients": tmp_path / "missing"}, "is not a folder of public"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            probe.attach(model, "layers.0.resid_post", endpoint="tcp://127.0.0.1:*", **kwargs)
        assert tapped(model) == 0
    with pytest.raises(ValueError, match="curve_client_key needs curve_server_key"):
        probe.Subscriber("tcp://127.0.0.1:1", curve_client_key=zmq.curve_keypair())
    (tmp_path / "server.key").write_text("not a certificate\n")
    for argv, message in [
        (["top", "tcp://127.0.0.1:1", "--curve-server", str(tmp_path / "nowhere.key")], "cannot read the CURVE"),
        (["top", "tcp://127.0.0.1:1", "--curve-client", str(tmp_path / "server.key")], "--curve-client needs"),
        (["record", "--model", "default", "--prompt", "x", "--out", str(tmp_path / "o"), "--curve-server",
          str(tmp_path / "server.key")], "apply to recording a running session"),
    ]:
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
