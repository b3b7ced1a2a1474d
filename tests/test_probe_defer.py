"""Decode steps are captured at their end: what each hook saw, exactly, or a clear drop when the model wrote
into a captured tensor after its hook."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import build

import probe

PROMPT = torch.tensor([[5, 17, 33, 9, 40]])
NEW = 4


def _clones(model: torch.nn.Module) -> tuple[dict[tuple[int, int], torch.Tensor], list]:
    """Per (layer, forward): a clone of the layer's output taken inside a forward hook (the oracle), and the
    handles. Registered after probe.attach, so they run after probebus's taps on the same call."""
    got: dict[tuple[int, int], torch.Tensor] = {}
    calls = [0] * len(model.model.layers)

    def keep(i: int):
        def hook(mod, args, out):
            got[(i, calls[i])] = (out[0] if isinstance(out, tuple) else out).detach().clone().reshape(-1, 64)
            calls[i] += 1
        return hook
    return got, [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]


def _run(model: torch.nn.Module, session: probe.ProbeSession, sub: probe.Subscriber, *, inference: bool = False):
    session.wait_for(sub)
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW, min_new_tokens=NEW,
                       do_sample=False, pad_token_id=0)
    stats = session.close()
    return [c for c in sub], stats


@pytest.mark.parametrize("inference", [False, True])
def test_every_capture_is_what_its_hook_saw(inference: bool) -> None:
    model = build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        session = probe.attach(model, "layers.*.resid_post", endpoint="tcp://127.0.0.1:*")
        sub = probe.Subscriber(session.endpoint)
        oracle, handles = _clones(model)
        caps, stats = _run(model, session, sub, inference=inference)
    for h in handles:
        h.remove()
    assert session._hooks.defer  # decode steps (and this short prefill) went through the deferred path
    assert stats.captured == stats.published == len(caps) == 3 * NEW and stats.dropped == 0
    first = min(c.step for c in caps)  # the session's step numbers; the oracle counts forwards from 0
    for cap in caps:
        torch.testing.assert_close(cap.tensor, oracle[(cap.layer, cap.step - first)], rtol=0, atol=0)


def test_a_tensor_written_after_its_hook_is_dropped_and_later_steps_copy_in_the_hook() -> None:
    model = build("llama")
    session = probe.attach(model, "layers.*.resid_post", endpoint="tcp://127.0.0.1:*")
    sub = probe.Subscriber(session.endpoint)
    before: list[torch.Tensor] = []

    def write_into_input(mod, args):
        before.append(args[0].detach().clone().reshape(-1, 64))  # layer 0's output as its hook saw it
        args[0].add_(1.0)  # then layer 1 changes it in place, before the step's end

    handle = model.model.layers[1].register_forward_pre_hook(write_into_input)
    with pytest.warns(UserWarning, match="wrote into layers.0.resid_post's tensor after its hook"):
        caps, stats = _run(model, session, sub)
    handle.remove()
    assert not session._hooks.defer
    # The prefill's layer-0 capture was stale: dropped, and counted. Every other one arrived.
    assert stats.dropped == 1 and stats.captured == stats.published + stats.dropped == 3 * NEW
    first = min(c.step for c in caps if c.layer == 2)  # the prefill's step number
    assert sorted(c.step - first for c in caps if c.layer == 2) == list(range(NEW))
    layer0 = sorted((c for c in caps if c.layer == 0), key=lambda c: c.step)
    assert [c.step - first for c in layer0] == list(range(1, NEW))
    for cap in layer0:  # copied inside the hook, before layer 1 wrote into it
        torch.testing.assert_close(cap.tensor, before[cap.step - first], rtol=0, atol=0)


def test_a_forward_that_raises_keeps_the_captures_it_made() -> None:
    model = build("llama")
    session = probe.attach(model, "layers.*.resid_post", endpoint="tcp://127.0.0.1:*")
    sub = probe.Subscriber(session.endpoint)
    session.wait_for(sub)

    def fail(mod, args):
        raise RuntimeError("the model fails in layer 2")

    handle = model.model.layers[2].register_forward_pre_hook(fail)
    with torch.no_grad(), pytest.raises(RuntimeError, match="fails in layer 2"):
        model(PROMPT)
    handle.remove()
    stats = session.close()  # the step never ended: close sends what its hooks took
    caps = list(sub)
    assert stats.captured == stats.published == 2 and stats.dropped == 0
    assert sorted(c.layer for c in caps) == [0, 1]


def _ident(batch: int, seq_len: int = 1):
    import numpy as np

    from probe._identity import DECODE, PREFILL, StepIdentity

    pos = np.arange(seq_len)[None, :].repeat(batch, 0)
    return StepIdentity(1, DECODE if seq_len == 1 else PREFILL, batch, seq_len, None, np.arange(batch), pos,
                        np.zeros((batch, seq_len), dtype=np.int64), torch.device("cpu"))


def test_vllm_steps_defer_only_after_a_check_on_the_engine_and_an_in_place_write_turns_deferral_off() -> None:
    """vLLM runs under inference_mode (no version counters): whether its kernels write into a captured tensor
    after the hook is checked on the running engine (`probe/vllm/_defer.py`), per batch size."""
    from probe._sites import SiteKey
    from probe.vllm._defer import EVERY, Deferral

    key = SiteKey.of("layers.0.resid_post")
    defer = Deferral(enabled=True)
    assert defer.begin([_ident(4, seq_len=3)]) == (None, None), "a prefill copies in its hooks"
    assert defer.begin([_ident(2), _ident(2)]) == (None, None), "so does a step of prefill and decode rows"
    deferred, check = defer.begin([_ident(4)])
    assert deferred is None and check is not None, "a batch size's first decode step is checked, not deferred"
    check.note(key, torch.randn(4, 64))
    assert defer.end(check, 4) == [] and defer.checks == 1
    for _ in range(EVERY):
        assert defer.begin([_ident(4)]) == ([], None)
    assert defer.steps == EVERY
    assert defer.begin([_ident(8)])[1] is not None, "another batch size is checked first"
    _, again = defer.begin([_ident(4)])
    assert again is not None, f"checked again after {EVERY} deferred steps"
    # What vLLM's fused add-and-norm does on a GPU: the residual the hook saw is added into in place.
    resid = torch.randn(4, 64)
    again.note(key, resid)
    resid.add_(torch.ones(4, 64))
    assert defer.end(again, 4) == ["layers.0.resid_post"]
    assert not defer.enabled and defer.begin([_ident(4)]) == (None, None), "never deferred again"
    # A tensor whose bytes are not one block cannot be checked: no deferral either.
    other = Deferral(enabled=True)
    _, check = other.begin([_ident(4)])
    check.note(key, torch.randn(64, 4).t())
    assert other.end(check, 4) and not other.enabled
    assert Deferral(enabled=False).begin([_ident(4)]) == (None, None), "a GPU worker never defers"
