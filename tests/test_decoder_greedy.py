"""Greedy speculative decoding equals plain greedy `generate`, token for token, batch 1 and batch > 1."""

from __future__ import annotations

import pytest
import torch
from models import PAD, build, left_padded

from decoder import NgramDrafter, SpeculativeDecoder
from decoder.drafters import Eagle3Config, Eagle3Drafter
from decoder.schedule import CostModel

PROMPTS = [[5, 17, 33, 9, 40, 41], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 8]]


def assert_same_or_near_tie(model: torch.nn.Module, got: torch.Tensor, want: torch.Tensor,
                            mask: torch.Tensor, tol: float = 1e-4) -> None:
    """Equal sequences; a difference is only tolerated (and reported) at a genuine near-tie (top-2 logit gap
    below `tol`: 1e-4 in fp32; bf16 rounds a verify block differently from one-token steps, so ~0.1 there)."""
    if torch.equal(got, want):
        return
    for r in range(want.shape[0]):
        diff = (got[r] != want[r]).nonzero()
        if len(diff) == 0:
            continue
        at = int(diff[0])
        prefix = want[r, :at][mask[r, : min(at, mask.shape[1])].bool().tolist() + [True] * max(0, at - mask.shape[1])]
        with torch.no_grad():
            logits = model(prefix[None]).logits[0, -1]
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        if gap > tol:
            raise AssertionError(f"row {r} differs at {at}: got {got[r, at:].tolist()} want {want[r, at:].tolist()} "
                                 f"(top-2 logit gap {gap:.2e}: not a near-tie)")
        pytest.xfail(f"near-tie at row {r}, position {at}: top-2 logit gap {gap:.2e}")


def _drafters(model: torch.nn.Module) -> dict[str, object]:
    torch.manual_seed(3)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model)
    return {"none": None, "ngram": NgramDrafter(), "eagle": eagle, "auto": "auto"}


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_generate(family: str, batch: int) -> None:
    model = build(family, layers=8)
    ids, mask = left_padded(PROMPTS[:batch])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    for name, drafter in _drafters(model).items():
        kw = {"model_drafter": _drafters(model)["eagle"]} if drafter == "auto" else {}
        schedule = "auto" if drafter == "auto" else "fixed"
        with SpeculativeDecoder(model, drafter, k=4, schedule=schedule, **kw) as spec:
            out = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
        assert_same_or_near_tie(model, out.sequences, want, mask)
        st = out.stats
        assert st.emitted == 24 * batch
        if name == "ngram":  # random weights loop, so prompt lookup must accept something here
            assert st.tau > 1.0 and st.target_forwards < 24


def test_eos_stops_each_row_like_generate() -> None:
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    eos = int(free[1, ids.shape[1] + 4])  # row 1 emits this at its 5th new token
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                              eos_token_id=eos, pad_token_id=PAD)
    with SpeculativeDecoder(model, NgramDrafter(), k=4) as spec:
        out = spec.generate(ids, mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=PAD)
    assert_same_or_near_tie(model, out.sequences, want, mask)


def test_sampling_runs_and_is_reproducible_with_a_seed() -> None:
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS)
    outs = []
    for _ in range(2):
        with SpeculativeDecoder(model, "auto", model_drafter=_drafters(model)["eagle"], k=3) as spec:
            outs.append(spec.generate(ids, mask, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                                      pad_token_id=PAD).sequences)
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (3, ids.shape[1] + 12)


def _names_the_cache_cache() -> bool:
    """Whether the installed transformers' forwards take `cache=` (newer releases) rather than `past_key_values=`."""
    from transformers import LlamaForCausalLM

    from decoder.forward._compat import cache_kw

    return cache_kw(LlamaForCausalLM.forward) == "cache"


def _flat_cost(batch: int, k: int, ratio: float) -> CostModel:
    """A cost curve where verifying L tokens costs 1 + ratio * (L - 1) units: the scheduler's decisions become
    deterministic (the machine's real timings are noise on a shared CPU)."""
    curve = [1e-3 * (1 + ratio * i) for i in range(k + 1)]
    return CostModel("test", {str(batch): {"verify": curve, "verify_capturing": curve, "step": 1e-5}}, adapt=False)


@pytest.mark.parametrize("batch", [1, 3])
def test_scheduler_greedy_equals_generate_and_follows_costs(batch: int) -> None:
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS[:batch])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    eagle = _drafters(model)["eagle"]
    # verifying more tokens is free: drafting pays, rounds take several tokens (random weights loop)
    with SpeculativeDecoder(model, "auto", model_drafter=eagle, k=4, cost=_flat_cost(batch, 4, 0.0)) as spec:
        cheap = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
    assert_same_or_near_tie(model, cheap.sequences, want, mask)
    assert cheap.stats.target_forwards < 24 and cheap.stats.drafted > 0
    # verifying one more token costs twice a whole step: nothing is worth drafting, every round is plain
    with SpeculativeDecoder(model, "auto", model_drafter=eagle, k=4, cost=_flat_cost(batch, 4, 2.0)) as spec:
        dear = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
    assert_same_or_near_tie(model, dear.sequences, want, mask)
    assert dear.stats.plain_rounds == dear.stats.rounds == 23 and dear.stats.drafted == 0


@pytest.mark.parametrize("drafter_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bf16_target_with_every_drafter_dtype(drafter_dtype: torch.dtype) -> None:
    """A bf16 target feeds bf16 features to a drafter in any dtype; greedy output equals bf16 `generate` up to
    bf16 near-ties, and sampling runs."""
    model = build("llama", layers=8, dtype=torch.bfloat16)
    ids, mask = left_padded(PROMPTS[:2])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    torch.manual_seed(3)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model).to(drafter_dtype)
    for drafter, kw in ((eagle, {"schedule": "fixed"}), ("auto", {"model_drafter": eagle}), (NgramDrafter(), {})):
        with SpeculativeDecoder(model, drafter, k=4, **kw) as spec:
            out = spec.generate(ids, mask, max_new_tokens=16, pad_token_id=PAD)
            sampled = spec.generate(ids, mask, max_new_tokens=16, pad_token_id=PAD, temperature=0.8, seed=1)
        assert out.stats.emitted == 32 and sampled.sequences.shape == want.shape
        assert_same_or_near_tie(model, out.sequences, want, mask, tol=0.1)


def test_streamer_receives_prompt_then_each_accepted_token() -> None:
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS[:1])

    class Collect:  # transformers' streamer interface
        def __init__(self) -> None:
            self.puts: list[list[int]] = []
            self.ended = False

        def put(self, value: torch.Tensor) -> None:
            self.puts.append(value.flatten().tolist())

        def end(self) -> None:
            self.ended = True

    streamer = Collect()
    with SpeculativeDecoder(model, NgramDrafter(), k=4, schedule="fixed") as spec:
        out = spec.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD, streamer=streamer)
        with pytest.raises(ValueError, match="batch size 1"):
            spec.generate(*left_padded(PROMPTS[:2]), max_new_tokens=4, streamer=Collect())
    assert streamer.puts[0] == ids[0].tolist() and streamer.ended
    assert sum(streamer.puts[1:], []) == out.sequences[0, ids.shape[1]:].tolist()
    assert any(len(p) > 1 for p in streamer.puts[1:])  # accepted drafts arrive together, as they are accepted


def test_probes_publish_during_the_decoders_own_calls_only() -> None:
    """Between calls the drafter's probes are off the model: a plain `generate` of the user's (or another
    decoder's call) publishes nothing into a session that nobody reads until the next call. Left on, six
    96-token calls of the default model filled it and `complete` back-pressure froze the model for 60 s."""
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS[:1])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              pad_token_id=PAD, eos_token_id=None)
    with SpeculativeDecoder(model, _drafters(model)["eagle"], k=3, schedule="fixed") as spec:
        first = spec.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD)
        during = spec.session.stats.captured
        assert during > 0 and first.stats.bus_s > 0  # the call itself did capture and read features
        for _ in range(3):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                               pad_token_id=PAD, eos_token_id=None)
        assert spec.session.stats.captured == during
        again = spec.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD)
        assert spec.session.stats.captured > during
    assert torch.equal(first.sequences, want) and torch.equal(again.sequences, want)


def test_packed_weights_serve_the_loops_forwards_and_step_aside_for_hooks(monkeypatch) -> None:
    """`decoder/forward/_packed.py`: the verify forward's linear layers, their weights packed once for oneDNN."""
    import decoder.forward._packed as packed_mod
    from decoder.forward._packed import PackedLinears

    torch.manual_seed(0)
    model = build("llama")
    default = PackedLinears.of(model)
    if default is None:
        pytest.skip("this torch build has no oneDNN linear ops")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert max(m.weight.numel() for m in linears) < packed_mod.MIN_ELEMENTS  # a tiny model: oneDNN would not pay
    assert default.kind == "head" and default.layers == [model.lm_head]
    monkeypatch.setattr(packed_mod, "MIN_ELEMENTS", 0)  # as if every layer were big enough
    packed_all = PackedLinears.of(model)
    assert packed_all.kind == "all" and len(packed_all.layers) == len(linears) > 1
    head_only = PackedLinears.of(model, max_bytes=1024)  # past the memory cap: the LM head alone
    assert head_only.kind == "head" and head_only.layers == [model.lm_head]
    assert PackedLinears.of(model, "head").layers == [model.lm_head] and PackedLinears.of(model, "none") is None
    with pytest.raises(ValueError, match="packed must be one of all, head, none"):
        PackedLinears.of(model, "some")
    down = model.model.layers[1].mlp.down_proj
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        plain = model(ids).logits
        one = model(ids[:, :1]).logits
        for packed in (packed_all, head_only):
            with packed.active():
                assert "forward" in model.lm_head.__dict__
                assert ("forward" in down.__dict__) == (packed is packed_all)
                out = model(ids).logits
                out_one = model(ids[:, :1]).logits
            assert not any("forward" in m.__dict__ for m in linears), "put back"
            torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out_one, one, rtol=1e-5, atol=1e-5)  # one token per row: packed too
    # oneDNN serves every packed layer's forward, one token per row included, and only inside `active()`.
    calls = []
    real = packed_mod._pointwise_op()
    monkeypatch.setattr(packed_mod, "_pointwise_op", lambda: lambda *a: calls.append(1) or real(*a))
    watched = PackedLinears.of(model)
    with torch.no_grad():
        with watched.active():
            model(ids[:, :1])
        assert len(calls) == len(watched.layers)
        model(ids[:, :1])
        assert len(calls) == len(watched.layers), "F.linear again once the block ends"
        with watched.active():  # a single row (batch 1, one token): F.linear is faster there, but for the head
            single = model(ids[:1, :1]).logits
        assert len(calls) == len(watched.layers) + 1
    torch.testing.assert_close(single, one[:1], rtol=1e-5, atol=1e-5)
    # A changed weight is packed again (the loop refreshes at the start of each call), inside the model as well.
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
        down.weight.mul_(0.5)
        packed_all.refresh()
        with packed_all.active():
            changed = model(ids).logits
    torch.testing.assert_close(changed, model(ids).logits.detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, plain, atol=1e-3)
    # Someone else's hook on the head (a probe on `logits`): the head is left as it is, the rest is packed.
    seen = []
    h = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    with torch.no_grad(), packed_all.active():
        assert "forward" not in model.lm_head.__dict__ and "forward" in down.__dict__
        model(ids)
    h.remove()
    assert seen == [(2, 7, model.config.vocab_size)]


def test_every_forward_of_a_call_takes_the_packed_weights(monkeypatch) -> None:
    """Greedy and sampled calls alike: the prefill and every one-token round go through `_packed.py` (a greedy
    call's plain rounds kept `F.linear` until their batch-8 rounds measured 0.92x `generate` for it), and
    `packed="none"` keeps `F.linear` everywhere."""
    import decoder.forward._packed as packed_mod

    if not packed_mod._ops_available():
        pytest.skip("this torch build has no oneDNN linear ops")
    calls = []
    real = packed_mod._pointwise_op()
    monkeypatch.setattr(packed_mod, "_pointwise_op", lambda: lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(0)
    model = build("llama", layers=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    # (the eager forwards: a second call's plain steps would otherwise run the compiled graph, which calls the
    # packed op from its own code: test_decoder_compiled.py)
    with SpeculativeDecoder(model, None, compiled=False) as spec:
        want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        assert not calls  # the model's own generate: F.linear, the packed weights are the loop's alone
        assert torch.equal(spec.generate(ids, max_new_tokens=6).sequences, want)
        spec.generate(ids, max_new_tokens=6, temperature=0.7, seed=1)
    # each call: its prefill (4 positions), then the 5 one-token rounds after the prefill's token
    assert [s[1] for s in calls] == [4, 1, 1, 1, 1, 1] * 2
    calls.clear()
    with SpeculativeDecoder(model, None, packed="none") as spec:
        spec.generate(ids, max_new_tokens=6)
    assert not calls


@pytest.mark.skipif(not _names_the_cache_cache(), reason="this transformers release names the cache "
                    "past_key_values itself: every other test here runs that way")
def test_a_transformers_release_that_names_the_cache_past_key_values() -> None:
    """transformers renamed a forward's `past_key_values` to `cache`; an older release (5.17 on a GPU host) takes
    `cache=` into its **kwargs and runs without the cache. A target whose forward declares the old name, and
    refuses the new one, must still get its cache from every forward of the loop (chains, n-gram trees, EAGLE-3
    with probes, the cost curve): greedy output equal to plain `generate`."""
    from transformers import LlamaForCausalLM

    from decoder.forward._compat import cache_kw

    class OldCacheName(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, **kwargs):
            if "cache" in kwargs:
                raise TypeError("forward() got an unexpected keyword argument 'cache'")
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              pad_token_id=PAD, eos_token_id=None)
    one = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with torch.no_grad():
        want_one = model.generate(input_ids=one, attention_mask=torch.ones_like(one), max_new_tokens=24,
                                  do_sample=False, pad_token_id=PAD, eos_token_id=None)
    model.__class__ = OldCacheName
    assert cache_kw(model.forward) == "past_key_values" and cache_kw(LlamaForCausalLM.forward) == "cache"
    for name, drafter in _drafters(model).items():
        if drafter is None:
            continue
        with SpeculativeDecoder(model, drafter, k=3) as spec:
            out = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
            assert_same_or_near_tie(model, out.sequences, want, mask)
            tree = spec.generate(one, max_new_tokens=24, pad_token_id=PAD)  # batch 1: n-gram trees in auto
            assert torch.equal(tree.sequences, want_one), name


def test_calls_run_in_inference_mode_and_hand_back_tensors_autograd_can_use(tmp_path, monkeypatch) -> None:
    """The loop's forwards run under `torch.inference_mode` (cheaper per op than `no_grad`), yet nothing the
    caller gets back is an inference tensor: the output feeds a forward with gradients, and the drafter still
    trains after a call built its tables (its rope table, measuring its step for the cost curve, is one: an op
    outside the mode reads it into an ordinary tensor, so it is never saved for backward as it is)."""
    from decoder.training._train import TrainConfig, ttt_loss

    model = build("llama", layers=8)
    torch.manual_seed(3)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model)
    monkeypatch.setenv("PROBEBUS_CACHE_DIR", str(tmp_path))  # the first call measures the curve, in the mode
    modes: list[bool] = []
    hook = model.register_forward_pre_hook(lambda m, a: modes.append(torch.is_inference_mode_enabled()))
    ids = torch.tensor([[5, 17, 33, 9, 40, 41, 5, 17, 33]])
    with SpeculativeDecoder(model, "auto", model_drafter=eagle, k=3) as spec:
        spec.cost.paths.pick = lambda key, paths=None: "spec"
        out = spec.generate(ids, max_new_tokens=16, pad_token_id=PAD)
    hook.remove()
    assert modes and all(modes)  # every forward: the curve's, the prefill, the rounds
    assert not out.sequences.is_inference()
    model.zero_grad()
    model(out.sequences).logits.logsumexp(-1).sum().backward()
    assert model.get_input_embeddings().weight.grad is not None

    length, h = 6, model.config.hidden_size
    toks = out.sequences[:, : length + 2]
    feats = torch.randn(1, length, 3 * h)
    targets = toks[:, 1: length + 1] % eagle.config.draft_vocab_size
    loss, _ = ttt_loss(eagle, model.get_input_embeddings(), toks, feats, targets, TrainConfig(ttt_steps=2))
    loss.backward()
    assert eagle.fc.weight.grad is not None
