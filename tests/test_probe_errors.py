"""Bad input gets a clear error and loses nothing: sites, architectures, endpoints, frames."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import zmq
from models import build

import probe
from probe._hooks import tapped
from probe._wire import ERROR_KINDS, HEADER, MAGIC, VERSION, encode_envelope


def test_unknown_site_lists_what_is_available() -> None:
    model = build("llama")
    with pytest.raises(probe.SiteError, match=r"available sites: embed, layers\.\{0\.\.2\}"):
        probe.attach(model, "layers.*.resid_pots")
    with pytest.raises(probe.SiteError, match="out of range; the model has 3 layers"):
        probe.match_sites(model, "layers.7.resid_post")
    with pytest.raises(probe.SiteError, match="bad layer selector"):
        probe.match_sites(model, "layers.x.resid_post")
    assert tapped(model) == 0


def test_patterns_select_the_right_sites() -> None:
    model = build("llama")
    assert probe.match_sites(model, "layers.-1.resid_pre") == ["layers.2.resid_pre"]
    assert probe.match_sites(model, "layers.0:2.mlp_out") == ["layers.0.mlp_out", "layers.1.mlp_out"]
    assert probe.match_sites(model, ["logits", "embed"]) == ["embed", "logits"]
    assert len(probe.match_sites(model, "*")) == len(probe.list_sites(model)) == 1 + 3 * 5 + 2
    m = probe.SiteMatcher("layers.1:3.resid_post")
    assert m.matches("layers.2.resid_post") and not m.matches("layers.3.resid_post")
    assert m.topics() == [b"layers."]


def test_parallel_residual_has_no_resid_mid() -> None:
    model = build("gpt-neox")
    assert "layers.0.resid_mid" not in probe.list_sites(model)
    with pytest.raises(probe.SiteError, match="parallel-residual"):
        probe.attach(model, "layers.0.resid_mid")
    assert "layers.0.resid_mid" in probe.list_sites(build("gpt-neox-sequential"))


def test_unmappable_architecture_is_a_clear_error() -> None:
    with pytest.raises(probe.ArchitectureError, match="cannot find a decoder-layer list"):
        probe.list_sites(torch.nn.Linear(4, 4))


def test_default_endpoint_is_private_and_remote_binds_are_refused() -> None:
    model = build("llama")
    with probe.attach(model, "embed") as session:
        assert session.endpoint.startswith("ipc://")
        folder = os.path.dirname(session.endpoint[len("ipc://"):])
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert not os.path.exists(folder)
    with pytest.raises(ValueError, match="refusing to bind"):
        probe.attach(model, "embed", endpoint="tcp://0.0.0.0:*")
    with probe.attach(model, "embed", endpoint="tcp://127.0.0.1:*") as session:
        assert session.endpoint.startswith("tcp://127.0.0.1:")
    with pytest.raises(ValueError, match="policy must be one of"):
        probe.attach(model, "embed", policy="lossy")
    assert tapped(model) == 0


def test_a_vllm_engine_refuses_remote_binds_too(capsys) -> None:
    """The vLLM attach checks the endpoint before it asks any worker (no engine is needed to see it refuse):
    from Python and from `probebus attach --vllm`, which reports it in one line."""
    import probe.vllm
    from probebus.cli import main

    class Engine:  # never reached: the endpoint is refused first
        def collective_rpc(self, method: str, args: tuple = ()) -> list:
            raise AssertionError(f"{method} was called for a refused endpoint")

    with pytest.raises(ValueError, match="refusing to bind"):
        probe.vllm.attach(Engine(), "layers.*.resid_post", endpoint="tcp://0.0.0.0:5555")
    assert main(["attach", "--vllm", "http://127.0.0.1:9", "--endpoint", "tcp://10.1.2.3:5555"]) == 2
    assert "refusing to bind" in capsys.readouterr().err


def test_wait_for_subscribers_times_out_clearly() -> None:
    with probe.attach(build("llama"), "embed") as session:
        with pytest.raises(TimeoutError, match="only 0 of 1 subscribers"):
            session.wait_for_subscribers(1, timeout=0.2)
        elsewhere = probe.Subscriber("tcp://127.0.0.1:1")  # connected to nothing
        with pytest.raises(TimeoutError, match="did not reach"):
            session.wait_for(elsewhere, timeout=0.2)
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub, timeout=10)
        assert session.stats.subscribers == 1


@pytest.mark.filterwarnings("ignore:probebus. the publisher speaks")
def test_malformed_frames_are_counted_and_ignored() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = probe.Subscriber(f"tcp://127.0.0.1:{port}")
    pub.recv()  # a subscription arrived: the subscriber is connected
    payload = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    tokens = torch.tensor([[7, 7], [0, 1], [5, 6]]).numpy().tobytes()
    site = b"layers.0.resid_post"

    def env(tok: bytes = tokens, pay: bytes = payload, **kw: int) -> bytes:
        f = dict(phase=0, dtype=1, step=1, layer=0, hidden=3) | kw
        return encode_envelope(b"run", site, f["phase"], f["dtype"], f["step"], f["layer"], f["hidden"], tok, pay)

    good = env()
    at = len(site) + 1  # where the fixed header starts
    bad = [
        [b"garbage"],
        [site + b"\x00short"],
        [good[:at] + b"XXXX" + good[at + 4:]],  # bad magic
        [good[:at + 4] + (VERSION + 1).to_bytes(2, "little") + good[at + 6:]],  # a future version
        [env(dtype=99)],
        [env(phase=9)],
        [env(pay=payload[:-4])],  # truncated payload
        [env(tok=tokens[:-8])],  # token rows disagree with n
        [b"logits" + good[len(site):]],  # topic disagrees with the header's site length
        [env(pay=b""), payload[:-1]],  # a separate payload frame of the wrong size
        [env(), payload],  # payload twice
        [good, b"x", b"y"],
        [b"layers.x.resid_post" + good[len(site):]],  # well-formed header, not a site name
        [env(layer=3)],  # the header's layer disagrees with the site name
        [b"\x00probebus/end {not json"],  # a broken control message
    ]
    # Twice: the second time every site and header start has been decoded once (the decoder's fast path
    # for starts it has validated must still catch each of these).
    for rnd in (1, 2):
        for frames in bad:
            pub.send_multipart(frames)
        pub.send_multipart([env(pay=b""), payload])  # a large-payload style message is fine too
        pub.send_multipart([good])
        caps = [sub.recv(timeout=5), sub.recv(timeout=5)]
        for cap in caps:
            assert cap is not None and cap.tensor.tolist() == [[0, 1, 2], [3, 4, 5]]
            assert cap.positions.tolist() == [0, 1] and cap.token_ids.tolist() == [5, 6]
            assert cap.site == site.decode() and cap.run == "run" and cap.layer == 0 and cap.phase == "prefill"
        assert sub.stats.malformed == rnd * len(bad) and sub.stats.received == 2 * rnd
        assert set(sub.stats.errors) <= set(ERROR_KINDS) and sum(sub.stats.errors.values()) == rnd * len(bad)
        assert sub.stats.errors["version"] == rnd and sub.stats.errors["site"] == 3 * rnd
    assert HEADER.size == 48 and MAGIC == b"PBUS"
    sub.close()
    pub.close(0)
