"""The bus under load: real sockets, a subscriber in another process, both policies."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from models import PAD, build, left_padded

import probe
from probe._hooks import tapped

CHILD = textwrap.dedent("""
    import json, sys, time, hashlib
    import probe
    endpoint, out, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    sub = probe.Subscriber(endpoint, sites=sys.argv[4] if len(sys.argv) > 4 else None, rcvhwm=4)
    digest, n, steps = hashlib.sha256(), 0, set()
    for cap in sub.iter(idle_timeout=30.0):
        time.sleep(delay)  # a deliberately slow consumer
        digest.update(cap.site.encode() + cap.positions.numpy().tobytes() + cap.tensor.numpy().tobytes())
        n += 1
        steps.add(cap.step)
    json.dump({"n": n, "sha": digest.hexdigest(), "malformed": sub.stats.malformed, "missed": sub.stats.missed,
               "ended": sub.ended}, open(out, "w"))
""")


def _child(endpoint: str, out: Path, delay: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, endpoint, str(out), str(delay)])


def _digest(caps: list[probe.Capture]) -> str:
    import hashlib
    d = hashlib.sha256()
    for cap in caps:
        d.update(cap.site.encode() + cap.positions.numpy().tobytes() + cap.tensor.numpy().tobytes())
    return d.hexdigest()


def _generate(model: torch.nn.Module, n: int = 12, long: bool = False, **kw) -> torch.Tensor:
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    if long:  # ~1 MB of prefill activations: more than the kernel's socket buffers can hide
        prompts = [list(range(3, 123)), list(range(10, 110))]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD, **kw)


def test_complete_policy_slow_subscriber_in_other_process_gets_everything(tmp_path: Path) -> None:
    model = build("llama")
    out = tmp_path / "child.json"
    # A ring of 8 KiB and tiny socket queues: the slow child must push back on the model.
    with probe.attach(model, "layers.*.*", policy="complete", capacity_bytes=64 << 10, sndhwm=2) as session:
        local = probe.Subscriber(session.endpoint, rcvhwm=100_000)
        child = _child(session.endpoint, out, 0.004)
        session.wait_for_subscribers(2, timeout=30)
        _generate(model, long=True)
    stats = session.stats
    child.wait(timeout=60)
    caps = list(local.iter(idle_timeout=1.0))
    got = json.loads(out.read_text())
    assert stats.dropped == 0 and stats.captured == stats.published == len(caps) == got["n"] == 15 * 12
    assert got["sha"] == _digest(caps)
    assert stats.stall_seconds > 0, "the producer should have felt back-pressure"


STALLED = textwrap.dedent("""
    import json, sys
    import probe
    sub = probe.Subscriber(sys.argv[1], rcvhwm=4)
    print("ready", flush=True)
    sys.stdin.readline()  # reads nothing until the parent's session has closed
    n = sum(1 for _ in sub.iter(idle_timeout=30.0))
    json.dump({"n": n, "malformed": sub.stats.malformed, "missed": sub.stats.missed, "ended": sub.ended},
              open(sys.argv[2], "w"))
""")


def test_best_effort_never_blocks_and_counters_add_up(tmp_path: Path) -> None:
    """A subscriber in another process that reads nothing while the model runs: under best_effort the model never
    waits for it, ZeroMQ drops at its full pipe, and it counts exactly what it lost. It cannot keep up whatever the
    machine's speed (it used to read 10 ms a capture, which a loaded machine's slow model let it keep up with):
    ~2.5 MB of prefill captures against a pipe of 1 + 4 messages and the kernel's socket buffers."""
    model = build("llama")
    out = tmp_path / "child.json"
    with probe.attach(model, "layers.*.*", policy="best_effort", capacity_bytes=4 << 10, sndhwm=1) as session:
        child = subprocess.Popen([sys.executable, "-c", STALLED, session.endpoint, str(out)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        session.wait_for_subscribers(1, timeout=30)
        for _ in range(3):
            _generate(model, n=16, long=True)
    stats = session.stats
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    child.wait(timeout=60)
    got = json.loads(out.read_text())
    assert stats.stall_seconds == 0.0
    assert stats.captured == stats.published + stats.dropped == 3 * 15 * 16
    # ZeroMQ drops at this subscriber's full pipe; the subscriber counts exactly what it lost.
    assert got["missed"] > 0, "a subscriber that read nothing while ~2.5 MB went by must have lost some"
    assert got["ended"] and got["n"] + got["missed"] == stats.published and got["malformed"] == 0


def test_close_removes_every_hook_and_output_is_unchanged() -> None:
    model = build("gpt2")
    before = _generate(model)
    hooks_before = tapped(model)
    session = probe.attach(model, "*")
    assert tapped(model) > hooks_before
    during = _generate(model)
    session.close()
    assert tapped(model) == hooks_before == 0
    assert not any("forward" in m.__dict__ for m in model.modules())  # every module has its own forward back
    assert torch.equal(before, during) and torch.equal(before, _generate(model))
    assert session.stats.captured == session.stats.published + session.stats.dropped


def test_add_and_remove_while_generating_from_the_model_thread() -> None:
    from transformers.generation.streamers import BaseStreamer

    model = build("qwen2")
    with probe.attach(model, "layers.0.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)

        class Switch(BaseStreamer):
            calls = 0

            def put(self, value: torch.Tensor) -> None:  # called by generate once per step
                Switch.calls += 1
                if Switch.calls == 3:
                    session.add("layers.1.mlp_out")
                if Switch.calls == 6:
                    session.remove("layers.0.resid_post")

            def end(self) -> None:
                pass

        ids = torch.tensor([[5, 6, 7]])
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None, streamer=Switch())
        assert session.sites == ["layers.1.mlp_out"]
    caps = list(sub.iter(idle_timeout=1.0))
    steps = {s: sorted(c.step for c in caps if c.site == s) for s in ("layers.0.resid_post", "layers.1.mlp_out")}
    # put() #1 is the prompt, #k (k>1) follows forward k-1: add after forward 2, remove after forward 5.
    assert steps["layers.0.resid_post"] == [1, 2, 3, 4, 5]
    assert steps["layers.1.mlp_out"] == [3, 4, 5, 6, 7, 8, 9, 10]


def test_add_and_remove_from_another_thread_take_effect_at_a_step_boundary() -> None:
    model = build("llama")
    with probe.attach(model, "layers.0.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        started = threading.Event()
        done = threading.Event()

        def flip() -> None:
            started.wait()
            session.add("layers.2.attn_out")
            session.remove("layers.0.resid_post")
            done.set()

        t = threading.Thread(target=flip)
        t.start()
        ids = torch.tensor([[5, 6, 7]])
        with torch.no_grad():
            model(ids)  # the model thread is now known; later changes from `flip` are deferred
            started.set()
            done.wait(10)
            model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
        t.join()
    caps = list(sub.iter(idle_timeout=1.0))
    first = [c for c in caps if c.step == 1]
    assert [c.site for c in first] == ["layers.0.resid_post"]
    later = [c for c in caps if c.step > 1]
    assert later and all(c.site == "layers.2.attn_out" for c in later)
    assert len(later) == 4


def test_pause_takes_the_taps_off_without_changing_the_announced_sites() -> None:
    """A paused session publishes nothing and leaves the model unprobed (its modules' own forward back); its
    site list, what subscribers and live_sessions see, stays, and its forwards are not counted as steps.
    resume() captures again; add/remove end a pause."""
    model = build("llama")
    layer = model.model.layers[0]
    plain_forward = type(layer).forward
    ids = torch.tensor([[5, 6, 7]])
    with probe.attach(model, "layers.0.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with torch.no_grad():
            model(ids)
            session.pause()
            assert session.stats.queued == 0  # a pause sends what was held: no step may come for a while
            assert session.paused and session.sites == ["layers.0.resid_post"]
            assert not tapped(layer) and layer.forward.__func__ is plain_forward
            assert [s.sites for s in probe.live_sessions() if s.endpoint == session.endpoint] == [session.sites]
            model(ids)
            model(ids)
            session.resume()
            assert not session.paused and tapped(layer)
            model(ids)
            session.pause()
            session.add("layers.1.mlp_out")  # a change of sites resumes, with the new list
            assert not session.paused and session.sites == ["layers.0.resid_post", "layers.1.mlp_out"]
            model(ids)
    stats = session.stats
    caps = list(sub.iter(idle_timeout=1.0))
    # paused forwards are not seen at all: the step count goes on from the last observed one
    assert sorted((c.step, c.site) for c in caps) == [(1, "layers.0.resid_post"), (2, "layers.0.resid_post"),
                                                     (3, "layers.0.resid_post"), (3, "layers.1.mlp_out")]
    assert stats.captured == stats.published == 4


@pytest.mark.parametrize("paused_from", ["another thread", "the model's thread"])
def test_pause_and_resume_from_another_thread_during_generate(paused_from: str) -> None:
    """pause()/resume() called from another thread while generate runs (the model's thread waits at a step boundary
    for the other thread only so that the test knows which steps fall in the pause): nothing is captured in
    between, every step after the resume is captured again, with the phase, seq_ids and positions of a session
    never paused. They used to stop captures for good, or bring fresh seq_ids and positions from 0."""
    from transformers.generation.streamers import BaseStreamer

    model = build("llama")
    prompt = [5, 6, 7]
    with probe.attach(model, "layers.0.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)

        def on_other_thread(fn: object) -> None:
            t = threading.Thread(target=fn)
            t.start()
            t.join(30)

        class Switch(BaseStreamer):
            calls = 0

            def put(self, value: torch.Tensor) -> None:  # on the model's thread, once per step
                Switch.calls += 1
                if Switch.calls == 3:
                    (on_other_thread if paused_from == "another thread" else lambda f: f())(session.pause)
                    assert session.paused
                if Switch.calls == 6:
                    on_other_thread(session.resume)
                    assert not session.paused

            def end(self) -> None:
                pass

        with torch.no_grad():
            model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                           streamer=Switch())
    caps = list(sub.iter(idle_timeout=2.0))
    # put() #1 is the prompt, #k follows forward k-1: paused after forward 2, resumed after forward 5; forwards
    # 6..10 decode positions 3 + 4 .. 3 + 8 of sequence 0 (forward 2 decodes position 3)
    got = [(c.phase, c.seq_ids.tolist(), c.positions.tolist()) for c in caps]
    want_after = [("decode", [0], [len(prompt) + k - 2]) for k in range(6, 11)]
    assert got[:2] == [("prefill", [0, 0, 0], [0, 1, 2]), ("decode", [0], [3])]
    assert got[2:] == want_after, got
    assert session.stats.captured == session.stats.published == 7


def test_taps_keep_a_replaced_forward_and_the_signature_transformers_reads() -> None:
    """Sites are taps on `forward` (not hooks; the model's step hooks are hooks, outside a compiled forward): a
    forward that something else put on the instance first (as accelerate does) is the one called, and is put
    back on close; one wrapped over ours afterwards survives the close and still reaches the module; `generate`
    sees forward's own parameters throughout."""
    model = build("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = _generate(model)
    with torch.no_grad():  # another copy: transformers records hidden states with hooks of its own
        hidden = build("llama")(ids, output_hidden_states=True).hidden_states
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    calls: list[str] = []
    theirs = layer0.forward

    def replaced(*args, **kwargs):
        calls.append("replaced")
        return theirs(*args, **kwargs)

    layer0.forward = replaced
    params = inspect.signature(model.forward).parameters
    session = probe.attach(model, "layers.0.resid_post,layers.1.resid_post")
    sub = probe.Subscriber(session.endpoint)
    session.wait_for_subscribers(1)
    assert inspect.signature(model.forward).parameters == params and "logits_to_keep" in params
    assert tapped(model) == 4 and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()
                                          if m is not model)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    ours = layer1.forward

    def later(*args, **kwargs):
        calls.append("later")
        return ours(*args, **kwargs)

    layer1.forward = later
    with torch.no_grad():
        model(ids)
    session.close()
    caps = {c.site: c.tensor for c in sub.iter(idle_timeout=2.0)}
    assert calls == ["replaced", "later"]
    assert torch.equal(caps["layers.0.resid_post"], hidden[1][0])
    assert torch.equal(caps["layers.1.resid_post"], hidden[2][0])
    assert layer0.forward is replaced and layer1.forward is later and "forward" not in model.__dict__
    assert tapped(model) == 0
    calls.clear()
    assert torch.equal(_generate(model), ref) and calls.count("replaced") == calls.count("later") > 0


def _layer1_capture(model: torch.nn.Module, hook) -> probe.Capture:
    """The one capture of layers.1.resid_post from a 4-token forward, with `hook` on layer 1 before the probe's."""
    h = model.model.layers[1].register_forward_hook(hook)
    with probe.attach(model, "layers.1.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7, 8]]))
    h.remove()
    (cap,) = list(sub.iter(idle_timeout=1.0))
    return cap


def test_dtypes_round_trip_bit_exactly() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        model = build("llama", dtype=dtype)
        ref: list[torch.Tensor] = []
        cap = _layer1_capture(model, lambda m, a, o, ref=ref: ref.append(o.detach().clone()))
        assert cap.tensor.dtype == dtype
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(cap.tensor.view(bits), ref[0][0].view(bits))


def test_views_with_an_offset_or_strides_are_captured_as_their_own_values() -> None:
    """Small captures copy a contiguous tensor's bytes from its data pointer: a view that starts inside
    its storage must give its own values, and a strided one goes through numpy."""
    views = {
        "offset": lambda o: torch.cat([o, 2 * o], dim=1)[:, o.shape[1]:],  # contiguous, starts mid-storage
        "strided": lambda o: torch.cat([o, 2 * o], dim=-1)[..., : o.shape[-1]],  # rows 2H apart
    }
    for name, view in views.items():
        model = build("llama")
        ref: list[torch.Tensor] = []

        def swap(m, a, o, view=view, ref=ref):
            out = view(o[0] if isinstance(o, tuple) else o)
            ref.append(out.detach().clone())
            return (out, *o[1:]) if isinstance(o, tuple) else out

        assert (name == "offset") == view(torch.zeros(1, 3, 4)).is_contiguous()
        cap = _layer1_capture(model, swap)  # swap runs before the probe's hook: the probe sees the view
        assert torch.equal(cap.tensor, ref[0][0]), name


def test_a_steps_small_captures_leave_together_at_its_end_even_past_one_bundle() -> None:
    """Small captures that fill more than one 64 KiB bundle wait for the step's end too: a send mid-forward
    wakes ZeroMQ's I/O thread while the model computes. All arrive, in order, exactly once. (A live subscriber:
    else the step's end may hold them for later steps' send.)"""
    model = build("llama", layers=3)  # 6 sites x 100 tokens x 64 x 4 B = 25 KiB each: 3 bundles per step
    seen: list[int] = []
    with probe.attach(model, ["layers.*.resid_post", "layers.*.mlp_out"]) as session:
        sub = probe.Subscriber(session.endpoint, live=True)
        session.wait_for(sub, timeout=10)
        h = model.model.norm.register_forward_hook(lambda m, a, o: seen.append(session.stats.published))
        with torch.no_grad():
            out = model(torch.arange(3, 103).unsqueeze(0), output_hidden_states=True)
        h.remove()
        assert seen == [0] and session.stats.published == 6  # nothing left during the forward, all at its end
    caps = list(sub.iter(idle_timeout=1.0))
    assert [c.site for c in caps] == [f"layers.{i}.{k}" for i in range(3) for k in ("mlp_out", "resid_post")]
    assert sub.stats.missed == 0 and sub.stats.malformed == 0
    for i in range(2):  # (transformers' last hidden state is the final norm's output, not layer 2's)
        torch.testing.assert_close(caps[2 * i + 1].tensor, out.hidden_states[i + 1][0])


def test_capture_larger_than_the_ring_is_still_delivered_under_complete() -> None:
    model = build("llama")
    with probe.attach(model, "layers.0.resid_pre", capacity_bytes=1024) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with torch.no_grad():
            out = model(torch.arange(3, 43).unsqueeze(0), output_hidden_states=True)  # 40 x 64 x 4 B = 10 KiB
    (cap,) = list(sub.iter(idle_timeout=1.0))
    torch.testing.assert_close(cap.tensor, out.hidden_states[0][0])


def test_bundles_only_while_nobody_filters_and_every_subscriber_gets_exactly_its_sites() -> None:
    """A step's small captures travel as one message while every subscriber takes every site; a subscriber
    that filters by site turns bundling off (ZeroMQ's per-site filter must keep working) until it leaves."""
    import zmq

    model = build("llama")
    sites = [f"layers.{i}.resid_post" for i in range(model.config.num_hidden_layers)]
    with probe.attach(model, "layers.*.resid_post", max_delay=0) as session:  # every step at its end
        raw = zmq.Context.instance().socket(zmq.SUB)  # counts the messages on the wire
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(session.endpoint)
        everything = probe.Subscriber(session.endpoint)
        session.wait_for(everything, timeout=10)
        _generate(model, n=4)
        assert session.publisher.bundling
        filtered = probe.Subscriber(session.endpoint, sites="layers.1.resid_post")
        session.wait_for(filtered, timeout=10)
        _generate(model, n=4)
        assert not session.publisher.bundling
        filtered.close()
        for _ in range(200):  # its unsubscription reaches the publisher at a later step or idle tick
            session.publisher.step_done()
            if session.publisher.bundling:
                break
            threading.Event().wait(0.02)
        assert session.publisher.bundling
        _generate(model, n=4)
    steps = 3 * 4  # per generate: one prefill and three decode steps (the last token is not fed back)
    caps = list(everything.iter(idle_timeout=5))
    assert everything.ended and everything.stats.missed == 0 and everything.stats.malformed == 0
    assert len(caps) == steps * len(sites)
    for site in sites:
        mine = [c.seq for c in caps if c.site == site]
        assert mine == list(range(steps)), site
    frames = []
    while raw.poll(100):
        frames.append(raw.recv_multipart())
    data = [f for f in frames if not f[0].startswith((b"\x00probebus/info", b"\x00probebus/end"))]
    bundles = [f for f in data if f[0].startswith(b"\x00probebus/bundle")]
    # bundled phases: one message per step; the filtered phase: one message per capture
    assert len(bundles) == 2 * 4 and len(data) == 2 * 4 + 4 * len(sites), (len(bundles), len(data))
    raw.close(0)


def test_a_filtered_subscriber_receives_its_sites_while_another_takes_everything(tmp_path: Path) -> None:
    model = build("llama")
    with probe.attach(model, "layers.*.resid_post") as session:
        everything = probe.Subscriber(session.endpoint)
        filtered = probe.Subscriber(session.endpoint, sites=["layers.0.resid_post", "layers.1.resid_post"])
        session.wait_for(everything, timeout=10)
        session.wait_for(filtered, timeout=10)
        out = _generate(model, n=6)
    all_caps = list(everything.iter(idle_timeout=5))
    mine = list(filtered.iter(idle_timeout=5))
    assert out.shape[1] > 6
    assert {c.site for c in mine} == {"layers.0.resid_post", "layers.1.resid_post"}
    assert _digest(mine) == _digest([c for c in all_caps if c.site in ("layers.0.resid_post", "layers.1.resid_post")])
    assert filtered.stats.missed == everything.stats.missed == 0 and filtered.stats.filtered == 0


def test_a_site_removed_from_another_thread_then_added_back_keeps_its_tap_until_close() -> None:
    """A removal from another thread waits for the next step; a re-add on the model's thread before then applies at
    once. The queued removal must not then drop the tap from the session's books while leaving it on the module:
    the site stopped capturing (its step hooks went with the last tap the session knew of), and `close()` left the
    tap behind."""
    model = build("llama")
    ids = torch.tensor([[5, 6, 7]])
    site = "layers.0.resid_post"
    with probe.attach(model, site) as session:
        n = tapped(model)  # the site's tap and the model's step hooks
        with torch.no_grad():
            model(ids)  # the session learns the model's thread
        t = threading.Thread(target=session.remove, args=(site,))
        t.start()
        t.join()
        session.add(site)
        before = session.stats.captured
        with torch.no_grad():
            model(ids)  # applies the queued removal
            model(ids)
        assert session.sites == [site]
        assert session.stats.captured == before + 2  # one capture a forward, as before the remove
        assert tapped(model) == n
    assert tapped(model) == 0


def test_adding_a_tapped_site_again_keeps_one_tap() -> None:
    model = build("llama")
    with probe.attach(model, "layers.*.resid_post") as session:
        n = tapped(model)
        session._hooks.change("add", session.sites)  # the hooks' own API, as a pause's resume or a benchmark uses it
        assert tapped(model) == n  # a second tap would capture every site twice and could not be removed
        session.pause()
        assert tapped(model) == 0
        session.resume()
        assert tapped(model) == n
