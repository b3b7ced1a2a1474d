"""Decode steps whose captures wait unpacked and are packed many steps at a time (`probe/_pending.py`): counted at
once, on the wire in the order of their steps, what each layer returned, and never stranded."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from models import build

import probe

PROMPT = torch.tensor([[5, 17, 33, 9, 40]])
LONG = torch.arange(3, 73)[None, :]  # a prefill of more rows than a step whose captures wait (DEFER_ROWS)
NEW = 6


def _oracle(model: torch.nn.Module) -> tuple[list[tuple[int, torch.Tensor]], list]:
    """Every layer output in call order, (layer, clone), taken by forward hooks registered after attach."""
    got: list[tuple[int, torch.Tensor]] = []

    def keep(i: int):
        def hook(mod, args, out):
            got.append((i, (out[0] if isinstance(out, tuple) else out).detach().clone().reshape(-1, 64)))
        return hook
    return got, [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]


def _generate(model: torch.nn.Module, new: int = NEW, prompt: torch.Tensor = PROMPT) -> None:
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)


def _session(model: torch.nn.Module, linger: float = 30.0) -> tuple[probe.ProbeSession, probe.Subscriber]:
    session = probe.attach(model, "layers.*.resid_post", max_delay=linger)
    session.publisher._adapt(linger / 100)  # as if a held send had cost the model's thread this much
    assert session.publisher.linger == linger
    sub = probe.Subscriber(session.endpoint)
    session.wait_for(sub, timeout=10)
    return session, sub


def test_waiting_steps_are_counted_at_once_and_arrive_in_step_order_as_the_layers_returned_them() -> None:
    model = build("llama")
    n = model.config.num_hidden_layers
    session, sub = _session(model)
    oracle, handles = _oracle(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        _generate(model)
        # The decode steps wait unpacked (the prefill went at its end), and count as captured already.
        assert session._copy.pending == n * (NEW - 1)
        assert session.stats.captured == n * NEW and session.stats.published == 0
        _generate(model)  # its prefill packs the first call's decode steps before its own captures
        assert session._copy.pending == n * (NEW - 1)
        _generate(model, prompt=LONG)  # and so does a prefill copied in its hooks
        assert session._copy.pending == n * (NEW - 1)
        stats = session.close()
    for h in handles:
        h.remove()
    caps = list(sub.iter(idle_timeout=10))
    assert stats.captured == stats.published == len(caps) == 3 * n * NEW and stats.dropped == 0
    assert sub.ended and sub.stats.missed == 0
    for i in range(n):
        mine = [c for c in caps if c.layer == i]
        assert [c.step for c in mine] == sorted(c.step for c in mine)  # on the wire in step order
        assert [c.seq for c in mine] == list(range(3 * NEW))
        want = [t for layer, t in oracle if layer == i]
        assert len(want) == len(mine)
        for cap, t in zip(mine, want, strict=True):
            torch.testing.assert_close(cap.tensor.reshape(-1, 64), t, rtol=0, atol=0)
    positions = [int(c.positions[-1]) for c in caps if c.layer == 0]
    # The prefill's last token, then one per decode step, in each call.
    assert positions == [4, 5, 6, 7, 8, 9] * 2 + list(range(69, 75))


def test_a_tensor_written_after_its_step_ended_is_dropped_when_packed_and_the_session_copies_in_its_hooks() -> None:
    model = build("llama")
    n = model.config.num_hidden_layers
    session, sub = _session(model)
    kept: list[torch.Tensor] = []
    handle = model.model.layers[1].register_forward_hook(lambda mod, args, out: kept.append(out))
    _generate(model)
    handle.remove()
    assert session._copy.pending == n * (NEW - 1)
    kept[-1].add_(1.0)  # the last decode step's layer-1 output, changed while it waits to be packed
    with pytest.warns(UserWarning, match="wrote into layers.1.resid_post's tensor after its hook"):
        session.sync()  # packs here; the warning is given at the model thread's next step end
        _generate(model, 2)
    assert not session._hooks.defer
    stats = session.close()
    caps = list(sub.iter(idle_timeout=10))
    assert stats.dropped == 1 and stats.captured == stats.published + 1 == n * (NEW + 2)
    assert len(caps) == n * (NEW + 2) - 1
    last = max(c.step for c in caps if c.layer == 0 and c.step <= NEW)
    assert [c.layer for c in caps if c.step == last] == [0, 2]  # the changed one is not on the wire


def test_a_model_that_stops_stepping_strands_no_waiting_step() -> None:
    """No flush, no close, no further step: the control thread packs and sends them once a linger old."""
    model = build("llama")
    n = model.config.num_hidden_layers
    session, sub = _session(model, linger=0.5)
    _generate(model)
    assert session._copy.pending > 0
    caps = []
    while len(caps) < n * NEW:
        cap = sub.recv(timeout=15)
        assert cap is not None, f"only {len(caps)} of {n * NEW} arrived"
        caps.append(cap)
    # the control thread counts a bundle published after its send returns: the last one's count may land just
    # after the subscriber has it (seen: all 18 received, 3 counted)
    deadline = time.monotonic() + 10
    while session.stats.published < n * NEW and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session._copy.pending == 0 and session.stats.published == n * NEW
    session.close()


@pytest.mark.parametrize("how", ["flush from another thread", "pause from another thread"])
def test_flush_and_pause_from_another_thread_send_the_waiting_steps(how: str) -> None:
    model = build("llama")
    n = model.config.num_hidden_layers
    session, sub = _session(model)
    _generate(model)
    assert session._copy.pending == n * (NEW - 1)
    other = threading.Thread(target=session.flush if how.startswith("flush") else session.pause)
    other.start()
    other.join()
    caps = [sub.recv(timeout=5) for _ in range(n * NEW)]
    assert all(c is not None for c in caps)
    assert session._copy.pending == 0 and session.stats.published == n * NEW
    session.close()


def test_nothing_waits_while_a_subscriber_is_live() -> None:
    model = build("llama")
    n = model.config.num_hidden_layers
    session = probe.attach(model, "layers.*.resid_post", max_delay=30.0)
    live = probe.Subscriber(session.endpoint, live=True)
    session.wait_for(live, timeout=10)
    assert session.publisher.live
    _generate(model)
    assert session._copy.pending == 0 and session.stats.published == n * NEW
    session.close()
    assert len(list(live.iter(idle_timeout=10))) == n * NEW
