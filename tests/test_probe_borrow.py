"""Large captures sent from the model's own tensor (`attach(borrow=True)`, the default): bit-exact against an
oracle that clones, on every supported family; and a model that writes into a captured tensor before the send
is caught by the tensor's version counter."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from models import FAMILIES, build, oracle_activations

import probe
from probe import _borrow

SITES = ["layers.*.resid_pre", "layers.*.resid_post", "layers.*.attn_out", "layers.*.mlp_out", "final_norm",
         "logits"]


def _big_batch() -> torch.Tensor:
    """4 rows x 256 tokens x hidden 64 x 4 B = 256 KiB a capture: every capture is borrowed."""
    assert 4 * 256 * 64 * 4 >= _borrow.BORROW_MIN
    return torch.randint(3, 128, (4, 256), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_borrowed_captures_equal_the_oracle_on_every_family(family: str) -> None:
    """No supported family writes into a captured tensor after its hook: every borrowed capture arrives
    bit-exact in another process's view of the bus, and none is counted torn."""
    model = build(family)
    ids = _big_batch()
    want = oracle_activations(model, ids)
    sites = SITES + (["layers.*.resid_mid"] if "resid_mid" in probe.resolve_arch(model).inner else [])
    with probe.attach(model, sites) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad():
            model(ids)
            model(ids)  # a second step: the first step's tensors are handed back (and checked) on the way
        borrowed = session._copy.borrowed
    caps = list(sub.iter(idle_timeout=5.0))
    sub.close()
    assert session.stats.torn == 0 and session.stats.dropped == 0
    assert borrowed == len(caps) > 0, (borrowed, len(caps))  # every capture went out from the model's tensor
    checked = 0
    for cap in caps:
        if cap.site not in want:
            continue  # resid_mid: no independent oracle here (test_probe_fidelity covers it)
        torch.testing.assert_close(cap.tensor, want[cap.site].reshape(-1, cap.tensor.shape[-1]), rtol=0, atol=0)
        checked += 1
    assert checked == len(caps) - (2 * model.config.num_hidden_layers if "layers.*.resid_mid" in sites else 0)


def test_a_tensor_written_in_place_before_its_send_is_never_sent_and_copying_takes_over() -> None:
    """A model that writes into a captured tensor in place after the hook (here a pre-hook of the next layer
    doubles its input) would have ZeroMQ send the new values: the version counter, checked just before the send at
    the step's end, catches it: that capture is never sent (counted torn and dropped at once, a subscriber counts
    it missed), the session warns, and copies every later capture at its hook. It used to be sent, unmarked."""
    model = build("llama")
    ids = _big_batch()
    clean = oracle_activations(model, ids)["layers.1.resid_post"]

    def double(mod, args, kwargs):
        (args[0] if args else kwargs["hidden_states"]).mul_(2)

    handle = model.model.layers[2].register_forward_pre_hook(double, with_kwargs=True)
    try:
        with probe.attach(model, "layers.1.resid_post") as session:
            sub = probe.Subscriber(session.endpoint)
            session.wait_for(sub)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.no_grad():
                    model(ids)
            assert session.stats.torn == 1 and session.stats.dropped == 1 and session.stats.published == 0
            assert any("wrote into a captured tensor" in str(w.message) for w in caught)
            with torch.no_grad():
                model(ids)
                model(ids)
        caps = list(sub.iter(idle_timeout=5.0))
        sub.close()
    finally:
        handle.remove()
    assert [c.seq for c in caps] == [1, 2] and sub.stats.missed == 1 and sub.stats.torn == 0
    for cap in caps:  # copied at the hook, before the next layer doubled the tensor
        torch.testing.assert_close(cap.tensor, clean.reshape(-1, 64), rtol=0, atol=0)
    assert session.stats.torn == 1 and session.stats.published == 2


def test_a_tensor_written_while_zeromq_sends_it_is_flagged_to_subscribers(tmp_path) -> None:
    """A write after the step's end, while ZeroMQ still sends the capture from the tensor (here: the subscriber
    reads nothing yet, so 3 MiB wait in the pipe), cannot be undone: the capture arrives with mixed values, and the
    session flags it in-band once it knows (site, seq in `Subscriber.torn`, `SubscriberStats.torn`); a recorder
    counts it in its manifest."""
    import json

    import exporters

    model = build("llama")
    ids = torch.randint(3, 128, (16, 256), generator=torch.Generator().manual_seed(0))  # 1 MiB a capture
    kept: list[torch.Tensor] = []
    handle = model.model.layers[0].register_forward_hook(lambda mod, args, out: kept.append(
        out[0] if isinstance(out, tuple) else out))
    try:
        with probe.attach(model, "layers.*.resid_post") as session:
            rec = exporters.ArrowRecorder(session, tmp_path / "rec").start()
            sub = probe.Subscriber(session.endpoint, rcvhwm=1)
            session.wait_for(sub)
            with torch.no_grad():
                model(ids)
            assert session.stats.published == 3 and session.stats.torn == 0
            assert session._copy._borrowed, "the first capture should still be in ZeroMQ's hands"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kept[0].mul_(2)  # the model's thread writes into the tensor ZeroMQ is sending
                caps = [sub.recv(timeout=10) for _ in range(3)]
                deadline = time.monotonic() + 10
                while session.stats.torn == 0 and time.monotonic() < deadline:
                    session._copy.return_borrowed()  # what the next capture or step end does first
                    time.sleep(0.01)
        rest = list(sub.iter(idle_timeout=5.0))
        sub.close()
        rec.stop()
    finally:
        handle.remove()
    assert all(c is not None for c in caps) and rest == []
    assert session.stats.torn == 1 and sub.stats.torn == 1 and list(sub.torn) == [("layers.0.resid_post", 0)]
    assert json.loads((tmp_path / "rec" / "_manifest.json").read_text())["counts"]["torn"] == 1


def test_borrow_false_copies_every_capture() -> None:
    model = build("llama")
    ids = _big_batch()
    with probe.attach(model, "layers.*.resid_post", borrow=False) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad():
            model(ids)
        assert session._copy.borrowed == 0
    assert len(list(sub.iter(idle_timeout=5.0))) == 3
    sub.close()
