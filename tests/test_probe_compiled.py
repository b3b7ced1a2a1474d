"""Probes on a compiled model: `model.forward` compiled with torch.compile (Inductor, `fullgraph=True`) before or
after attach, transformers' static and dynamic caches, greedy and sampled; every capture checked against the
eager oracle (transformers' `output_hidden_states` and plain hooks), and what attach, pause, resume and close
compile counted in Dynamo's own counters."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from models import PAD, build, left_padded, oracle_activations
from torch._dynamo.utils import counters

import probe

PROMPTS = [[5, 17, 33, 9, 12], [40, 41, 42]]
NEW_TOKENS = 6  # (logits are left out: generate computes them for the last prompt token only)
SITES = ["layers.*.resid_pre", "layers.*.resid_post", "layers.*.attn_out", "layers.*.mlp_out", "final_norm"]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Dynamo's cache is per code object, shared by every model of a class: each test starts from an empty one
    (and counts its graphs from 0)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    """Graphs Dynamo has compiled in this process (since the last reset)."""
    return counters["stats"]["unique_graphs"]


def _generate(model: torch.nn.Module, cache: str, sample: bool) -> torch.Tensor:
    ids, mask = left_padded(PROMPTS)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    if sample:
        torch.manual_seed(7)
        kw.update(temperature=0.8, top_k=0)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                              pad_token_id=PAD, do_sample=sample, **kw)


def _check_against_oracle(model: torch.nn.Module, gen: torch.Tensor, caps: list[probe.Capture],
                          sites: list[str] = SITES) -> None:
    """Every capture equals the oracle of its row's real sequence at its position; every site x fed token once."""
    model.__dict__.pop("forward", None)  # the oracle runs eager (the compiled forward is an instance attribute)
    width = left_padded(PROMPTS)[0].shape[1]
    seqs = [p + gen[b, width:].tolist() for b, p in enumerate(PROMPTS)]
    oracles = [{k: v[0] for k, v in oracle_activations(model, torch.tensor([s])).items()} for s in seqs]
    first = min(int(s) for c in caps for s in c.seq_ids)
    seen: set[tuple[str, int, int]] = set()
    for cap in caps:
        for row in range(cap.n_tokens):
            b, pos = int(cap.seq_ids[row]) - first, int(cap.positions[row])
            key = (cap.site, b, pos)
            assert key not in seen, f"duplicate capture {key}"
            seen.add(key)
            assert int(cap.token_ids[row]) == seqs[b][pos]
            torch.testing.assert_close(cap.tensor[row], oracles[b][cap.site][pos], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, key=key: f"{key}: {m}")
    n_sites = len(probe.match_sites(model, sites))
    assert len(seen) == sum(len(s) - 1 for s in seqs) * n_sites  # the last token is never fed
    assert {c.phase for c in caps} == {"prefill", "decode"}


@pytest.mark.parametrize(("cache", "order", "sample"),
                         [("static", "before", False), ("dynamic", "after", True), ("static", "never", False)])
def test_a_compiled_generate_publishes_what_eager_computes(cache: str, order: str, sample: bool) -> None:
    """Compiled before attach, after it, or not at all (a static cache hands the model a 4-D mask: the padding
    is read from it)."""
    model = build("llama", layers=2)
    eager = _generate(model, cache, sample)
    if order == "before":
        model.forward = torch.compile(model.forward, fullgraph=True)
        assert torch.equal(_generate(model, cache, sample), eager) or sample
    with probe.attach(model, SITES) as session:
        if order == "after":
            model.forward = torch.compile(model.forward, fullgraph=True)
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        gen = _generate(model, cache, sample)
    caps = list(sub.iter(idle_timeout=2.0))
    sub.close()
    assert (graphs() >= 2) == (order != "never"), "the forward ran compiled"
    if not sample:
        assert torch.equal(gen, eager)
    stats = session.stats
    assert stats.captured == stats.published == len(caps) and stats.dropped == 0
    _check_against_oracle(model, gen, caps)


def test_pause_resume_close_and_a_second_session_reuse_the_compiled_graphs() -> None:
    """Attach compiles the forward once more, with the taps in it; pause, resume, close and a second session
    with the same sites find their graphs in Dynamo's cache, and each captures exactly when it should."""
    model = build("llama", layers=2)
    model.forward = torch.compile(model.forward, fullgraph=True)
    _generate(model, "static", False)
    unprobed = graphs()

    def run(session: probe.ProbeSession) -> int:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        _generate(model, "static", False)
        session.flush()
        n = sum(c.n_tokens for c in sub.iter(idle_timeout=1.0))
        sub.close()
        return n

    per_generate = (sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NEW_TOKENS - 1)) * 2  # 2 sites
    session = probe.attach(model, "layers.*.resid_post")
    assert run(session) == per_generate
    probed = graphs()
    assert probed > unprobed  # the taps are in a graph of their own
    session.pause()
    assert run(session) == 0
    session.resume()
    assert run(session) == per_generate
    session.close()
    _generate(model, "static", False)
    with probe.attach(model, "layers.*.resid_post") as second:
        assert run(second) == per_generate
    assert graphs() == probed, "pause, resume, close and a second attach compiled nothing"


def test_two_sessions_on_one_compiled_model_each_get_their_own_sites() -> None:
    """Two sessions whose sites share modules (layer 0 tapped before and after by one, after by both): each gets its
    own sites' captures, as eager computes them, from the same graph outputs; once one closes, the other keeps
    capturing exactly its own."""
    model = build("llama", layers=2)
    model.forward = torch.compile(model.forward, fullgraph=True)
    eager = _generate(model, "static", False)
    sites_a, sites_b = ["layers.*.resid_post"], ["layers.0.resid_pre", "layers.*.resid_post"]
    a, b = probe.attach(model, sites_a), probe.attach(model, sites_b)
    subs = [probe.Subscriber(s.endpoint) for s in (a, b)]
    for s, sub in zip((a, b), subs, strict=True):
        s.wait_for(sub)
    gen = _generate(model, "static", False)
    b.close()
    a.flush()
    caps_a, caps_b = (list(sub.iter(idle_timeout=2.0)) for sub in subs)
    later = _generate(model, "static", False)
    a.close()
    caps_later = list(subs[0].iter(idle_timeout=2.0))
    for sub in subs:
        sub.close()
    assert torch.equal(gen, eager) and torch.equal(later, eager)
    _check_against_oracle(model, gen, caps_a, sites_a)
    _check_against_oracle(model, gen, caps_b, sites_b)
    _check_against_oracle(model, later, caps_later, sites_a)


def test_a_compiled_forward_that_raises_after_its_graph_loses_nothing_and_compiles_nothing() -> None:
    """A hook of the user's raises after the compiled forward, so the session's step end never runs: the next
    forward sends that step's captures first, and finds its graph in Dynamo's cache (the staged tensors left waiting
    would have failed its guard and compiled the forward again)."""
    model = build("llama", layers=2)
    model.forward = torch.compile(model.forward, fullgraph=True)
    failing = [True]  # the first call only

    def user_hook(module: torch.nn.Module, args: tuple, out: object) -> None:
        if failing:
            failing.pop()
            raise RuntimeError("the user's hook")
    model.register_forward_hook(user_hook)  # before attach: it runs before the session's step end
    ids = torch.tensor([PROMPTS[0]])
    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="the user's hook"):
                model(ids)
            compiled = graphs()
            model(ids)
        assert graphs() == compiled, "the second forward found its graph"
    caps = list(sub.iter(idle_timeout=2.0))
    sub.close()
    assert len(caps) == 2 * 2 and len({c.step for c in caps}) == 2
    assert session.stats.captured == session.stats.published == 4 and session.stats.dropped == 0
    model.__dict__.pop("forward")
    oracle = {k: v[0] for k, v in oracle_activations(model, ids).items()}
    for cap in caps:
        assert cap.positions.tolist() == list(range(len(PROMPTS[0])))
        torch.testing.assert_close(cap.tensor, oracle[cap.site], atol=1e-4, rtol=1e-4)


def test_a_compiled_call_keeps_each_step_identity() -> None:
    """The whole `__call__` compiled, fullgraph (the step hooks run outside the graph), a hand-written decode loop
    over a dynamic cache: positions, tokens and values as eager computes them."""
    from transformers import DynamicCache

    model = build("llama", layers=2)
    call = torch.compile(model.__call__, fullgraph=True)
    ids = torch.tensor([PROMPTS[0]])
    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        cache, seq, mask = DynamicCache(config=model.config), ids, torch.ones_like(ids)
        with torch.no_grad():
            out = call(input_ids=ids, attention_mask=mask, past_key_values=cache)
            for _ in range(4):
                nxt = out.logits[:, -1:].argmax(-1)
                seq, mask = torch.cat([seq, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
                out = call(input_ids=nxt, attention_mask=mask, past_key_values=cache)
    caps = list(sub.iter(idle_timeout=2.0))
    assert graphs() >= 2
    oracle = {k: v[0] for k, v in oracle_activations(model, seq).items()}
    steps = sorted({c.step for c in caps})
    assert len(steps) == 5 and len(caps) == 5 * 2
    for cap in caps:
        pos = cap.positions.tolist()
        assert cap.token_ids.tolist() == seq[0, pos].tolist() and cap.seq_ids.tolist() == [0] * len(pos)
        torch.testing.assert_close(cap.tensor, oracle[cap.site][pos], atol=1e-4, rtol=1e-4)
    assert [len(c.positions) for c in caps if c.site == "layers.0.resid_post"] == [len(PROMPTS[0])] + [1] * 4


def test_a_compiled_module_keeps_each_step_identity() -> None:
    """`torch.compile(model)`, fullgraph: the step hooks, which Dynamo skips by their code objects (`_compiled.eager`),
    run outside the graph around each call, and each step's rows are eager's."""
    model = build("llama", layers=2)
    compiled = torch.compile(model, fullgraph=True)
    seq = torch.tensor([PROMPTS[0]])
    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad():
            for n in (len(PROMPTS[0]), 3, 4):  # three forwards of their own (no cache): each a prefill
                compiled(input_ids=seq[:, :n])
    caps = list(sub.iter(idle_timeout=2.0))
    assert graphs() >= 1 and len(caps) == 3 * 2
    oracle = {k: v[0] for k, v in oracle_activations(model, seq).items()}
    for cap in caps:
        assert cap.positions.tolist() == list(range(cap.n_tokens))
        torch.testing.assert_close(cap.tensor, oracle[cap.site][: cap.n_tokens], atol=1e-4, rtol=1e-4)


def test_a_static_cache_length_read_at_its_address_follows_the_cache() -> None:
    """`cache_length` reads a static cache's 0-d length tensor at its address: it follows in-place updates, a reset,
    and another cache read in between, as `int(get_seq_length())` does."""
    from transformers import StaticCache

    from probe._identity import cache_length

    model = build("llama", layers=2)
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    with torch.no_grad():
        for i, cache in enumerate(caches):
            model(torch.tensor([PROMPTS[0][: 2 + i]]), past_key_values=cache)
        for _ in range(3):
            for cache in caches:
                assert cache_length(cache) == int(cache.get_seq_length())
                n = cache_length(cache)
                model(torch.tensor([[7]]), past_key_values=cache, cache_position=torch.tensor([n]))
        caches[0].reset()
        assert cache_length(caches[0]) == int(caches[0].get_seq_length()) == 0
        assert cache_length(caches[1]) == int(caches[1].get_seq_length()) == 3 + 3


def test_a_forward_that_runs_none_of_the_taps_is_reported() -> None:
    """A session must never capture nothing in silence: a forward that goes around the tapped modules (as a graph
    exported or captured elsewhere would) gets a warning that says so and what to do."""
    model = build("llama", layers=2)
    model.forward = copy.deepcopy(model).forward  # the same computation, through modules nobody tapped
    with probe.attach(model, "layers.*.resid_post") as session:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(torch.tensor([[5, 6, 7]]))
    assert session.stats.captured == 0
    assert any("ran none of its taps" in str(w.message) and "torch.compile" in str(w.message) for w in caught)
