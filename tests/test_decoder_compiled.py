"""The loop on a compiled target (`SpeculativeDecoder(..., compiled=True)`): greedy output equals plain greedy
`generate` token for token, with chains, trees, n-gram and EAGLE-3 (whose forwards run graphs with the probes'
taps in them), at batch 1 and on a left-padded batch; the forwards really ran compiled; the static cache grows
when a call outruns it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from models import PAD, build, left_padded
from test_decoder_greedy import PROMPTS, assert_same_or_near_tie

import probe
from decoder import NgramDrafter, SpeculativeDecoder
from decoder.drafters import Eagle3Config, Eagle3Drafter
from decoder.forward._compiled import CompiledForward, StaticLoopCache
from decoder.forward._kv import GrowingCache
from decoder.schedule import CostModel


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build("llama", layers=4)  # (few layers: each graph compiles in a fresh CI machine's cold Inductor cache)


def _eagle(model: torch.nn.Module) -> Eagle3Drafter:
    torch.manual_seed(3)
    return Eagle3Drafter(Eagle3Config.for_target(model.config, aux_layer_ids=[1, 2, 3])).bind_target(model)


@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_loop_greedy_equals_generate(model: torch.nn.Module, batch: int) -> None:
    ids, mask = left_padded(PROMPTS[:batch])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    kinds = [(NgramDrafter(), {"schedule": "fixed"}), (_eagle(model), {"schedule": "fixed"})]
    if batch == 1:
        kinds.append(("auto", {"model_drafter": _eagle(model), "ngram_tree": 0}))
    k = 2 if batch == 1 else 1  # (the batch's graphs: lengths 1-2, with and without taps; batch 1 runs 1-3)
    for drafter, kw in kinds:
        with SpeculativeDecoder(model, drafter, k=k, compiled=True, **kw) as spec, _counted(spec) as calls:
            out = spec.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD)
            again = spec.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD)  # the graphs run again
        assert_same_or_near_tie(model, out.sequences, want, mask)
        assert_same_or_near_tie(model, again.sequences, want, mask)
        assert out.stats.emitted == 20 * batch
        assert len(calls) >= out.stats.target_forwards, "the rounds' forwards did not run compiled"


def test_compiled_tree_rounds_equal_generate(model: torch.nn.Module) -> None:
    ids, mask = left_padded(PROMPTS[:1])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    # a flat cost curve: every round grows its tree (a measured one, on a loaded machine, may choose none)
    flat = CostModel("test", {"1": {"verify": [1e-3] * 8, "verify_capturing": [1e-3] * 8, "step": 1e-5}},
                     adapt=False)
    with SpeculativeDecoder(model, _eagle(model), k=2, schedule="fixed", tree=4, compiled=True, cost=flat) as spec:
        out = spec.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD)
    assert_same_or_near_tie(model, out.sequences, want, mask)
    assert out.stats.tree_rounds > 0


def _verify_captures(model: torch.nn.Module, compiled: bool) -> list[tuple[str, list[int], torch.Tensor]]:
    """What a second subscriber of the decoder's own bus reads of its verify forwards: (site, positions, rows)."""
    ids, mask = left_padded(PROMPTS[:1])
    flat = CostModel("test", {"1": {"verify": [1e-3] * 8, "verify_capturing": [1e-3] * 8, "step": 1e-5}},
                     adapt=False)  # (given: nothing measured, so no forwards of a measurement on the bus)
    # k = 6: every verify forward has 7 tokens, which the compiled loop runs in the graph of 9 (`bucket`)
    with SpeculativeDecoder(model, _eagle(model), k=6, schedule="fixed", compiled=compiled, cost=flat) as spec:
        session = spec.drafters.session
        sub = probe.Subscriber(session.endpoint)
        try:
            session.wait_for_subscribers(2)
            spec.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD)
            got = []
            while (cap := sub.recv(timeout=2.0)) is not None:
                if cap.phase == "verify":
                    got.append((cap.site, cap.positions.tolist(), cap.tensor.clone()))
        finally:
            sub.close()
    return got


def test_compiled_padded_forwards_publish_exactly_the_eager_loops_rows(model: torch.nn.Module) -> None:
    """A compiled forward runs padded to its graph's length with the drafter's taps in it: the bus carries its
    real rows only, the same rows and values the eager loop's forwards publish."""
    eager, compiled = _verify_captures(model, False), _verify_captures(model, True)
    assert [(s, p) for s, p, _ in compiled] == [(s, p) for s, p, _ in eager]
    assert any(len(p) == 7 for _, p, _ in eager)  # (padded forwards were among them)
    for (_, _, a), (_, _, b) in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_compiled_sampling_runs_and_keeps_its_budget(model: torch.nn.Module) -> None:
    ids, mask = left_padded(PROMPTS[:3])  # (the batch of the greedy test: its graphs)
    with SpeculativeDecoder(model, NgramDrafter(), k=1, schedule="fixed", compiled=True) as spec:
        out = spec.generate(ids, mask, max_new_tokens=16, temperature=0.8, seed=1, pad_token_id=PAD)
    assert out.stats.emitted == 48
    assert out.sequences.shape == (3, ids.shape[1] + 16)
    assert int(out.sequences.max()) < model.config.vocab_size


@torch.inference_mode()
def test_static_cache_grows_and_keeps_its_columns(model: torch.nn.Module) -> None:
    """A call that outruns its static cache gets a larger one with the filled columns copied: the next forward's
    logits equal the eager forward's over a GrowingCache holding the same tokens."""
    fwd = CompiledForward(model)  # (its own caches: the model's shared one may hold a larger cache, which serves)
    cache = fwd.new_cache(1, 8)
    assert isinstance(cache, StaticLoopCache) and cache.capacity == 256
    grown_ref = GrowingCache(400)
    ids = torch.randint(3, model.config.vocab_size, (1, 250))
    fwd(ids, torch.arange(250)[None], None, cache, "cache", compiled=False)
    model(ids, position_ids=torch.arange(250)[None], cache=grown_ref, use_cache=True)
    nxt = torch.randint(3, model.config.vocab_size, (1, 9))
    got = fwd(nxt, torch.arange(250, 259)[None], None, cache, "cache")  # 250 + a graph of 9 > 256 columns
    want = model(nxt, position_ids=torch.arange(250, 259)[None], cache=grown_ref, use_cache=True).logits
    assert cache.capacity == 512 and cache.get_seq_length() == 259
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_a_longer_prompt_runs_the_graphs_compiled_before(model: torch.nn.Module) -> None:
    """The cache's capacity is a dynamic dimension of the graphs: a call whose prompt needs a larger static cache
    compiles nothing more (before, each capacity compiled every graph again, inside the call), and still equals
    `generate`."""
    short, long_ = torch.tensor([[5, 9, 11, 4]]), torch.randint(3, model.config.vocab_size, (1, 300))
    graphs = torch._dynamo.utils.counters["stats"]
    with SpeculativeDecoder(model, NgramDrafter(), k=2, schedule="fixed", compiled=True) as spec:
        spec.generate(short, max_new_tokens=8)
        before = graphs["unique_graphs"]
        out = spec.generate(long_, max_new_tokens=12)
        assert graphs["unique_graphs"] == before
    with torch.no_grad():
        want = model.generate(input_ids=long_, max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD)
    assert_same_or_near_tie(model, out.sequences, want, torch.ones_like(long_))


def test_compiled_auto_compiles_batch_1_calls_from_the_second_on(model: torch.nn.Module) -> None:
    """compiled="auto": a decoder's first call runs eagerly (a one-off call pays no compile), its later batch-1
    calls compiled, batch 3 eagerly, each way on its own cost curve; by default a drafting call's forwards stay
    eager."""
    one, three = left_padded(PROMPTS[:1]), left_padded(PROMPTS[:3])
    with SpeculativeDecoder(model, NgramDrafter(), k=2, schedule="fixed", compiled="auto") as spec:
        ran = []
        for ids, mask in (one, one, three, one):
            spec.generate(ids, mask, max_new_tokens=6, pad_token_id=PAD)
            ran.append((spec.static, spec.cost.key))
        eager_key, compiled_key = ran[0][1], ran[1][1]
        assert [static for static, _ in ran] == [False, True, False, True]
        assert eager_key != compiled_key and ran[2][1] == eager_key and ran[3][1] == compiled_key
    with SpeculativeDecoder(model, NgramDrafter(), k=2, schedule="fixed") as spec:
        for _ in range(2):
            spec.generate(*one, max_new_tokens=6, pad_token_id=PAD)
            assert not spec.static
    with pytest.raises(ValueError, match="compiled must be"):
        SpeculativeDecoder(model, None, compiled="yes")


@contextlib.contextmanager
def _counted(spec: SpeculativeDecoder) -> Iterator[list[int]]:
    """A list that grows by one at each call of the target's compiled graphs (the decoder's `CompiledForward`, which
    every decoder of the model shares: put back after)."""
    compiled, calls = spec.target.compiled, []
    inner = compiled.fn
    compiled.fn = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    try:
        yield calls
    finally:
        compiled.fn = inner


def test_plain_steps_run_the_compiled_graph_from_the_second_batch_1_call_on(model: torch.nn.Module) -> None:
    """By default (compiled="plain") a decoder with nothing to draft steps eagerly in its first call, then on the
    compiled one-token graph in its later batch-1 calls (batch 3 eagerly); compiled=False never compiles. Every call
    equals `generate`."""
    one, three = left_padded(PROMPTS[:1]), left_padded(PROMPTS[:3])
    with torch.no_grad():
        want = {b: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=PAD) for b, (ids, mask) in ((1, one), (3, three))}
    with SpeculativeDecoder(model, None) as spec:
        assert spec.compiled == "plain"
        ran = []
        with _counted(spec) as calls:
            for b, (ids, mask) in ((1, one), (1, one), (3, three), (1, one)):
                before = len(calls)
                out = spec.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD)
                assert_same_or_near_tie(model, out.sequences, want[b], mask)
                ran.append((spec.static, len(calls) - before))
    assert [static for static, _ in ran] == [False, True, False, True]
    assert ran[0][1] == ran[2][1] == 0
    assert ran[1][1] >= 11 and ran[3][1] >= 11, ran  # every step but the prefill's (eager: the prompt's length)
    with SpeculativeDecoder(model, None, compiled=False) as spec:
        for _ in range(2):
            spec.generate(*one, max_new_tokens=6, pad_token_id=PAD)
            assert not spec.static and spec.target.compiled is None


def test_a_sampled_call_that_loses_hands_its_rest_to_the_compiled_graph(model: torch.nn.Module,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled call that measures itself losing continues as plain steps; from a decoder's second call on they
    run on the compiled one-token graph, the call's cache copied onto a static one (`StaticLoopCache.load`). Near
    temperature 0 a sample is the argmax, so every call must equal greedy `generate` across the switch."""
    from decoder.loop import _plain

    monkeypatch.setattr(_plain, "HAND_OVER_LOSS", 0.0)  # (every sampled call "loses" once it decoded 32 tokens)
    ids, mask = left_padded(PROMPTS[:1])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    with SpeculativeDecoder(model, NgramDrafter(), k=2) as spec:  # scheduled: calls choose their path
        outs, ran = [], []
        with _counted(spec) as calls:
            for _ in range(3):
                before = len(calls)
                outs.append(spec.generate(ids, mask, max_new_tokens=60, temperature=1e-4, pad_token_id=PAD))
                ran.append(len(calls) - before)
    # the path choice measures each path once (speculative, then plain), then speculative keeps a call
    assert [o.stats.path for o in outs] == ["spec", "plain", "spec"]
    assert outs[0].stats.handed_over > 0 and outs[2].stats.handed_over > 0
    assert ran[0] == 0, "a decoder's first call compiled"
    assert ran[1] >= 59 and ran[2] >= outs[2].stats.handover_steps > 0, (ran, outs[2].stats.handover_steps)
    for out in outs:
        assert_same_or_near_tie(model, out.sequences, want, mask)


def test_a_one_row_graph_calls_the_packed_op_for_the_head_alone() -> None:
    """In a compiled forward the packed layers are calls of `probebus::packed_linear` (`_packed.py`), each a call
    back into Python. A graph of several rows calls it for every packed layer (their weights would be repacked
    otherwise); a batch-1 one-token graph for the head alone (the other layers' single row has nothing to repack);
    both give the eager forward's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # an MLP big enough to be packed (MIN_ELEMENTS), one layer (one cold compile in CI)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=1024, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.inference_mode():
        _one_row_graph_checks(model)


def _one_row_graph_checks(model: torch.nn.Module) -> None:
    from torch.profiler import profile

    fwd = CompiledForward(model)
    packed = fwd.packed
    assert packed is not None and packed.kind == "all" and len(packed.layers) == 4  # gate, up, down, head
    ref = GrowingCache(64)
    ids = torch.tensor([[5, 6, 7, 8]])
    cache = fwd.new_cache(1, 8)
    fwd(ids, torch.arange(4)[None], None, cache, "cache", compiled=False)
    model(ids, position_ids=torch.arange(4)[None], cache=ref, use_cache=True)
    for length in (1, 3):
        nxt = torch.randint(3, 1024, (1, length))
        pos = torch.arange(cache.get_seq_length(), cache.get_seq_length() + length)[None]
        fwd.warm(1, 300, [length], "cache")  # (compiled first, on a cache of its own)
        with profile() as prof:
            got = fwd(nxt, pos, None, cache, "cache")
        want = model(nxt, position_ids=pos, cache=ref, use_cache=True).logits
        calls = sum(e.count for e in prof.key_averages() if e.key == "probebus::packed_linear")
        assert calls == (1 if length == 1 else 4), (length, calls)
        assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_the_oracle_bound_runs_eagerly_after_a_compiled_call(model: torch.nn.Module) -> None:
    """The oracle's replay (`oracle_bound`) runs eager forwards on a cache of its own, whatever the decoder's last
    call ran: it once took the last call's static cache and crashed on a mask of the eager loop's width."""
    from decoder.loop import oracle_bound

    ids, mask = left_padded(PROMPTS[:1])
    with SpeculativeDecoder(model, "auto", model_drafter=_eagle(model), k=2, ngram_tree=0, compiled="auto") as spec:
        for _ in range(2):
            spec.generate(ids, mask, max_new_tokens=6, pad_token_id=PAD)
        assert spec.static  # (the second call ran compiled)
        res = oracle_bound(spec, ids, mask, max_new_tokens=12)
    assert res.tokens == 12 and res.seconds > 0


def test_compiled_loop_follows_weights_changed_between_calls(model: torch.nn.Module) -> None:
    """The compiled graphs read packed copies of the linear layers (`packed_linear`): a weight changed between two
    calls is packed again, and the second call still equals `generate` of the changed model."""
    ids, mask = left_padded(PROMPTS[:1])
    head = model.get_output_embeddings()  # (the layer this small model packs)
    kept = head.weight.data
    try:
        with SpeculativeDecoder(model, NgramDrafter(), k=2, schedule="fixed", compiled=True) as spec:
            spec.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD)
            head.weight.data = kept.flip(0).contiguous()  # a new tensor: a packed copy of the old one is stale
            with torch.no_grad():
                want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                      eos_token_id=None, pad_token_id=PAD)
            out = spec.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD)
    finally:
        head.weight.data = kept
    assert_same_or_near_tie(model, out.sequences, want, mask)


def test_a_model_with_compiled_forwards_is_freed_and_copies_compile_their_own() -> None:
    """One CompiledForward per model, kept on the model: dropping the model frees both (a weak map keyed by the model,
    whose value held it, never let a model go); a deep copy, or the model saved and loaded, compiles its own."""
    import copy
    import gc
    import weakref

    model = build("llama", layers=2)
    fwd = CompiledForward.of(model)
    assert CompiledForward.of(model) is fwd
    with torch.inference_mode():
        fwd(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], None, fwd.new_cache(1, 8), "cache", compiled=False)
    twin = copy.deepcopy(model)
    assert CompiledForward.of(twin) not in (None, fwd) and CompiledForward.of(twin).model is twin
    gone = weakref.ref(model)
    del model, fwd
    gc.collect()
    assert gone() is None
